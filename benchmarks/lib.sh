# The helpers every benchmarks/*.sh device script sources (after it sets OUT, where it uses step or pack_out):
#   source "$(dirname "$0")/lib.sh"
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
wait_ready() {  # wait_ready PID LOG [SECONDS] [PORT]: poll a server's /health (default port 8123) once a second until it answers 200; sets READY_S, the seconds waited. Returns 1 (printing "server died" and LOG's last lines) if PID exits first, 2 (printing "not ready in SECONDS s") after SECONDS (default 300); the caller stops the server
  local pid=$1 log=$2 limit=${3:-300} port=${4:-8123} start=$SECONDS
  until python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=5)" 2> /dev/null; do
    kill -0 "$pid" 2> /dev/null || { echo "server died"; tail "$log"; return 1; }
    [ $((SECONDS - start)) -ge "$limit" ] && { echo "not ready in $limit s"; return 2; }
    sleep 1
  done
  READY_S=$((SECONDS - start))
}
