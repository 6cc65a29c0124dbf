"""Build the embedded model's tokenizer and the task suite's held-out test sets.

    python training/build_assets.py training/tokenizer   # writes the tokenizer files there
        --test-sets src/flash_dllm/tasks/data           # and the committed test sets there

    python training/build_assets.py training/tokenizer --keep-tokenizer \
        --test-sets src/flash_dllm/tasks/data --tasks pairs perm pick   # only these tasks' test sets

Test items come from seeds disjoint from training's ("test-*" against "train-*"); training also skips
any prompt that appears in a test set.
"""
import argparse
import gzip
import random
from pathlib import Path

from tokenizers import Tokenizer

from llada_tokenizer import train_llada_tokenizer

from flash_dllm.tasks import CHOICE_TASKS, TASKS, generate

VOCAB_SIZE = 1024
CONTEXT = 8192
ANSWER_TOKENS = 128  # generation length: solution, <|eot_id|>, then <|endoftext|> padding
TEST_ITEMS = 500
PASSKEY_TEST_LENGTHS = (256, 512, 1024, 1536, 1900)  # the first 500 items, as built for the 2,048-token model
FIRST_TASKS = ("arith", "trace", "passkey")  # runs 1-6: the vocabulary's corpus and the first 500 test items
LONG_TEST_ITEMS = 100  # per length, from seeds of their own so that the items above stay as they were
LONG_TEST_LENGTHS = {"passkey": (2048, 4096, 8000), "multikey": (512, 1024, 2048, 4096, 8000)}


def corpus(num_items: int):
    rng = random.Random("tokenizer-corpus")
    for i in range(num_items):
        task = FIRST_TASKS[i % len(FIRST_TASKS)]
        item = generate(task, rng, num_tokens=256) if task == "passkey" else generate(task, rng)
        yield item.prompt
        yield item.solution


def build_test_sets(out: Path, tokenizer, tasks=TASKS):
    out.mkdir(parents=True, exist_ok=True)
    count = lambda text: len(tokenizer.encode(text).ids)
    for task in tasks:
        items, seen = [], set()
        if task in FIRST_TASKS or task in CHOICE_TASKS:
            rng = random.Random(f"test-{task}")
            while len(items) < TEST_ITEMS:
                if task == "passkey":
                    length = PASSKEY_TEST_LENGTHS[len(items) % len(PASSKEY_TEST_LENGTHS)]
                    item = generate(task, rng, num_tokens=length, count_tokens=count)
                else:
                    item = generate(task, rng)
                if item.prompt not in seen and count(item.solution) < ANSWER_TOKENS:
                    seen.add(item.prompt)
                    items.append(item)
        for length in LONG_TEST_LENGTHS.get(task, ()):
            rng = random.Random(f"test-{task}-{length}")
            for _ in range(LONG_TEST_ITEMS):
                items.append(generate(task, rng, num_tokens=length, count_tokens=count))
        text = "".join(item.to_json() + "\n" for item in items).encode()
        (out / f"{task}.jsonl.gz").write_bytes(gzip.compress(text, mtime=0))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--test-sets", type=Path)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=TASKS,
                        help="build only these tasks' test sets (the others' files stay as they are)")
    parser.add_argument("--keep-tokenizer", action="store_true",
                        help="load the tokenizer already in OUT instead of training a new one (a shipped "
                             "model's vocabulary must not change)")
    args = parser.parse_args()
    if args.keep_tokenizer:
        tokenizer = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    else:
        tokenizer = train_llada_tokenizer(corpus(30000), VOCAB_SIZE, args.out, model_max_length=CONTEXT)
    if args.test_sets:
        build_test_sets(args.test_sets, tokenizer, args.tasks)


if __name__ == "__main__":
    main()
