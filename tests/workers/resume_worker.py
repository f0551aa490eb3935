"""``rpb train`` that dies by SIGKILL right after its checkpoint at step K is complete, leaving a
half-written checkpoint K+1 behind (as a kill during the next save would; none after the final checkpoint,
where the kill interrupts the final save):
``python tests/workers/resume_worker.py K override ...``; with ``RPB_KILL_DURING_SAVE=1``, killed inside the save of
checkpoint K itself instead (its weights on disk, its optimizer state not)."""

import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

from rpb.train.config import load_config
from rpb.train.run import run_training


class Die(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if self.step < state.max_steps:  # after the final checkpoint the kill hits the final save instead
                torn = Path(args.output_dir) / f"checkpoint-{self.step + 1}"
                torn.mkdir()
                (torn / "model.safetensors").write_bytes(b"\0" * 100)  # a save cut short: no marker
            os.kill(os.getpid(), signal.SIGKILL)


def die_during_save(step: int) -> None:
    """SIGKILL inside the Trainer's save of checkpoint ``step``: its weights written, its optimizer state not."""
    from transformers import Trainer

    real = Trainer._save_optimizer_and_scheduler

    def save(self, output_dir):
        if self.state.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, output_dir)

    Trainer._save_optimizer_and_scheduler = save


if __name__ == "__main__":
    step = int(sys.argv[1])
    if os.environ.get("RPB_KILL_DURING_SAVE"):
        die_during_save(step)
        callbacks = []
    else:
        callbacks = [Die(step)]
    run_training(load_config(None, sys.argv[2:]), progress=False, callbacks=callbacks)
