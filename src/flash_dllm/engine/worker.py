"""A tensor-parallel worker rank's process: `python -m flash_dllm.engine.worker`, started by its driver
(tensor_parallel.WorkerProcess), its arguments pickled on stdin. A fresh interpreter: the user's script is never
imported, so it needs no `if __name__ == "__main__":` guard."""
import pickle
import sys

from .tensor_parallel import worker_main

if __name__ == "__main__":
    worker_main(*pickle.load(sys.stdin.buffer))
