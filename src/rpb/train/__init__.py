"""``rpb train``, start to end: post-training a Hugging Face MoE model with an anchor under the Trainer.

In the order a run goes through them: ``config`` reads the YAML and its overrides and lists every problem at once;
``validate`` checks a prior against the data file and the model (``rpb validate``; here, not in ``rpb.prior``,
since it reads the data, the anchors, the collector's clip and the adapters, which all import the prior's math);
``dryrun`` goes through every stage a run would refuse without loading the model (``rpb train --dry-run``);
``run`` is the job (model, data, anchor, Trainer arguments; ``run_training``); ``start`` writes what the log
opens with before the first step; ``trainer`` is the Trainer with the anchor's step context and ``log.jsonl``;
``checkpoints`` makes runs resumable; ``lora`` is the ``lora:`` section with PEFT; ``audit`` is ``rpb audit``'s job
on an ``rpb train`` configuration.

Nothing is re-exported: import each name from its module (docs/api.md says which), so importing this package
loads none of them.
"""
