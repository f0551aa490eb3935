"""``rpb audit``'s job: an ``rpb train`` configuration built as ``rpb train`` builds it, then audited.

Everything ``rpb train`` checks before training is checked here too (the prior against the model, data and
template; the configuration's own problems). The Trainer is given a temporary output directory, removed after;
nothing is written but the JSON report asked for.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from rpb.fileio import write_text_atomic
from rpb.monitor.asked import asked_from_config
from rpb.monitor.audit import AuditReport, audit
from rpb.train.config import load_config


def run_audit(config: str, overrides: list[str] = (), rows: int = 4, out: str | None = None) -> AuditReport:
    from rpb.train.run import prepare_run, training_arguments
    from rpb.train.trainer import AnchorTrainer

    cfg = load_config(config, overrides)
    prepared = prepare_run(cfg, progress=False)
    try:
        with tempfile.TemporaryDirectory(prefix="rpb-audit-") as scratch:
            cfg = dataclasses.replace(cfg, output_dir=scratch, train=dataclasses.replace(cfg.train, report_to=["none"]))
            trainer = AnchorTrainer(
                model=prepared.model,
                args=training_arguments(cfg, progress=False),
                train_dataset=prepared.dataset,
                data_collator=prepared.collator,
                anchor=prepared.handle,
                expert_mask=prepared.expert_mask,
            )
            report = audit(trainer, asked_from_config(cfg), rows=rows, adapter=cfg.adapter)
    finally:
        prepared.handle.remove()
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(out), json.dumps({"config": config, **report.to_dict()}, indent=1))
    return report
