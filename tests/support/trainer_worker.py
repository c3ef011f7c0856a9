"""One rank of a multi-process test run: `torchrun --nproc_per_node N tests/support/trainer_worker.py CFG.toml`."""

import sys

from trainer.config import load_config
from trainer.train import train

if __name__ == "__main__":
    train(load_config(sys.argv[1]), say=lambda _: None)
