# The `step` function, sourced by the benchmarks/*.sh device scripts (after they set OUT).
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, print its last TAIL lines (default 4) through FILTER (a command, default cat); returns the command's status
  local name=$1 limit=$2 rc; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; rc=$?; echo "## $name (rc $rc)"
  ${FILTER:-cat} < "$OUT/$name.txt" | tail -n "${TAIL:-4}"
  return $rc
}
pack_out() {  # pack_out NAME: the device returns at most 8 files: past that, $OUT's files (but earlier packs) go into $OUT/NAME.tgz
  local files; files=$(find "$OUT" -type f | wc -l)
  [ "$files" -le 8 ] && return
  (cd "$OUT" && find . -type f ! -name '*.tgz' -print0 | tar czf "/tmp/$1.tgz" --null -T - --remove-files && mv "/tmp/$1.tgz" .)
  echo "## $OUT: $files files packed into $1.tgz"
}
