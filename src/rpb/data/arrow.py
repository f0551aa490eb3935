"""rpb's labelled rows as a ``datasets.Dataset``, for trainers that take one (TRL, axolotl).

Imported by those integrations only: ``datasets`` comes with them, not with rpb.
"""

from __future__ import annotations

import datasets

from rpb.data.batches import ExampleDataset, LossOn
from rpb.data.dataset import Example, LabelledData
from rpb.errors import ConfigError

#: the per-token columns rpb's collator needs besides TRL's ``input_ids`` / ``labels``
RPB_COLUMNS = ("span_ids", "sample_index")


def as_dataset(train_dataset, loss_on: LossOn = "answer") -> datasets.Dataset:
    """rpb's labelled rows as a ``datasets.Dataset`` (``input_ids``, ``labels``, ``span_ids``,
    ``sample_index``): from ``LabelledData``, an ``ExampleDataset``, a list of ``Example`` or a Dataset
    that already holds those columns."""
    if isinstance(train_dataset, datasets.Dataset):
        missing = [c for c in ("input_ids", "labels", *RPB_COLUMNS) if c not in train_dataset.column_names]
        if missing:
            raise ConfigError(
                "train_dataset",
                [
                    f"lacks the column(s) {missing}: give rpb's labelled rows (rpb.data.load_labelled on the data "
                    "file the prior was collected on)"
                ],
            )
        return train_dataset
    if isinstance(train_dataset, LabelledData):
        train_dataset = ExampleDataset(train_dataset.examples, loss_on)
    elif isinstance(train_dataset, list) and all(isinstance(e, Example) for e in train_dataset):
        train_dataset = ExampleDataset(train_dataset, loss_on)
    if not isinstance(train_dataset, ExampleDataset):
        raise ConfigError(
            "train_dataset",
            [
                f"must be rpb's labelled rows (LabelledData, ExampleDataset, a list of Example, or a datasets.Dataset "
                f"with input_ids, labels, span_ids and sample_index), got {type(train_dataset).__name__}"
            ],
        )
    rows = [train_dataset[i] for i in range(len(train_dataset))]
    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "labels", *RPB_COLUMNS)})
