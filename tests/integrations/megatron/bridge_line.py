"""What rpb touches of one Megatron-Bridge line, checked against that line's own code:
``python tests/integrations/megatron/bridge_line.py LINE ROOT WORK`` with only that line's folder (ROOT)
first on PYTHONPATH, so the line never shares an environment with another or with rpb's transformers.

A module is imported for real when it imports on a CPU machine; one that imports Transformer Engine or
NVIDIA ModelOpt at import time (GPU-only) is parsed instead, and reported as such. Prints one JSON
object, the last line: versions, each object's check and how it was made ("imported" / "parsed").

WORK holds ``data.jsonl``, the tokenizer in ``tok/`` and ``paths.json`` (the container fields
``build_container`` sets, recorded by the test).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import platform
import sys
import types
from functools import partial
from pathlib import Path

GPU_ONLY = ("transformer_engine", "modelopt")


def parse(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text(), filename=rel)


def function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]]


def try_import(name: str):
    """The module, or the GPU-only package that stops it importing here (any other failure is raised)."""
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in GPU_ONLY:
            return None, e.name.split(".")[0]
        raise
    except ImportError as e:
        # a name the package's own __init__ would have defined (AutoBridge: Transformer Engine behind it)
        if "from 'megatron.bridge'" in str(e):
            return None, "transformer_engine, through megatron.bridge's __init__"
        raise


#: where the classes of the container's sections live (Bridge's and megatron-core's source in the line's folder)
CLASS_SOURCES = (
    "megatron/bridge/models",
    "megatron/bridge/training",
    "megatron/core/transformer",
    "megatron/core/optimizer",
    "megatron/core/distributed",
    "megatron/core/model_parallel_config.py",
    "megatron/training",
)


def dataclass_fields(root: Path) -> dict[str, tuple[set[str], list[str]]]:
    """class name -> (annotated fields, base names) for every class in ``CLASS_SOURCES``."""
    out: dict[str, tuple[set[str], list[str]]] = {}
    for rel in CLASS_SOURCES:
        base = root / rel
        for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(), filename=str(path))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                              and isinstance(s.target, ast.Name)}  # fmt: skip
                    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                    known, known_bases = out.get(node.name, (set(), []))
                    out[node.name] = (known | fields, known_bases + bases)
    return out


def all_fields(index, name: str, seen=None) -> set[str]:
    seen = seen if seen is not None else set()
    if name in seen or name not in index:
        return set()
    seen.add(name)
    fields, bases = index[name]
    return fields.union(*(all_fields(index, b, seen) for b in bases))


def section_classes(root: Path) -> dict[str, list[str]]:
    """ConfigContainer's sections -> the class names their annotations name (training/config.py)."""
    tree = parse(root, "megatron/bridge/training/config.py")
    container = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ConfigContainer")
    out = {}
    for s in container.body:
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            out[s.target.id] = [n.id for n in ast.walk(s.annotation) if isinstance(n, ast.Name)]
    return out


def field_report(root: Path, paths: list[str]) -> dict[str, bool]:
    """Each ``section.field`` rpb sets: whether the section's class (or a base, megatron-core included) has it.
    The model section's classes are the recipe's provider chain: every ``*ModelProvider*`` and megatron-core's
    ``TransformerConfig`` family count."""
    index, sections = dataclass_fields(root), section_classes(root)
    out = {}
    for path in paths:
        section, name = path.split(".", 1)
        classes = sections.get(section, [])
        if section == "model":
            classes = [c for c in index if "ModelProvider" in c or c.endswith("TransformerConfig")]
        out[path] = any(name in all_fields(index, c) for c in classes)
    return out


def bridge_package(root: Path) -> str:
    """Make ``megatron.bridge`` a package object without running its ``__init__`` (which imports AutoBridge,
    hence Transformer Engine); its submodules then import for real."""
    init = root / "megatron" / "bridge" / "__init__.py"
    _, blocker = try_import("megatron.bridge")
    sys.modules.pop("megatron.bridge", None)
    pkg = types.ModuleType("megatron.bridge")
    pkg.__path__ = [str(init.parent)]
    sys.modules["megatron.bridge"] = pkg
    return f"parsed ({blocker} at import)" if blocker else "imported"


def imported_line(line: str, root: Path, work: Path, out: dict) -> None:
    """v0.3.1: the SFT dataset, the sampler and the loss for real; the rest parsed."""
    import torch

    from rpb.data import load_labelled
    from rpb.integrations.megatron.bridge import ContextIterator, anchored_loss, rpb_sft_dataset, sft_dataset_class
    from rpb.integrations.megatron.config import load_megatron_config
    from rpb.models import load_tokenizer

    objects = out["objects"]
    # rpb's own Megatron path under this line's transformers: the anchors, the router patch, the checks
    for name in ("rpb.anchors", "rpb.integrations.megatron.install", "rpb.integrations.megatron.verify",
                 "rpb.integrations.megatron.guard"):  # fmt: skip
        importlib.import_module(name)
    out["rpb_modules"] = "imported"
    objects["megatron.bridge (package __init__)"] = bridge_package(root)
    cls = sft_dataset_class()
    objects[f"{cls.__module__}.GPTSFTDataset"] = "imported"
    from megatron.bridge.data.datasets.utils import build_index_files

    tok = load_tokenizer(str(work / "tok"))
    data = load_labelled(str(work / "data.jsonl"), tok, 256)
    build_index_files([str(work / "data.jsonl")], newline_int=10, workers=1)
    n = data.num_rows
    orders, tokens = {}, {}
    for seed in (42, 43):
        cfg = load_megatron_config(None, ["model.pretrained_checkpoint=/c", f"data.root={work}", "data.file=data.jsonl",
                                          "train.output_dir=/o", "train.seq_length=256", f"data.seed={seed}",
                                          "prior=/p", "data.pad_to_multiple=8"])  # fmt: skip
        ds = rpb_sft_dataset(cfg, data.examples, 0, tok, max_num_samples=2 * n)
        items = [ds[i] for i in range(len(ds))]
        orders[seed] = [it["sample_index"] for it in items]
        tokens.update({it["sample_index"]: _hash(it) for it in items})
    out["dataset"] = {"len": len(ds), "rows": len(ds.indexed_dataset), "orders": orders, "token_sha256": tokens}
    # Moonlight's kind of tokenizer (remote code, tiktoken, slow): the same rows through Bridge's dataset
    moon = load_tokenizer(str(work / "moon"), trust_remote_code=True)
    moon_data = load_labelled(str(work / "data.jsonl"), moon, 256)
    moon_ds = rpb_sft_dataset(cfg, moon_data.examples, 0, moon, max_num_samples=n)
    moon_items = [moon_ds[i] for i in range(n)]
    out["moonshot"] = {
        "tokenizer": type(moon).__name__,
        "token_sha256": {it["sample_index"]: _hash(it) for it in moon_items},
    }

    from megatron.bridge.data.samplers import build_pretraining_data_loader

    objects["megatron.bridge.data.samplers.build_pretraining_data_loader"] = "imported"
    loader = build_pretraining_data_loader(ds, 0, "batch", micro_batch_size=2, num_workers=0, data_sharding=False,
                                           collate_fn=ds.collate_fn, data_parallel_rank=0, data_parallel_size=1,
                                           global_batch_size=4)  # fmt: skip

    class Handle:
        def __init__(self):
            self.seen = []

        def set_micro_batch(self, sample_BS, span_BS):
            self.seen.append(sample_BS[:, 0].tolist())

    from megatron.bridge.data.finetuning import prepare_finetuning_batch

    # Bridge's own split of the loader's global batch into the micro-batches the forward step reads
    objects["megatron.bridge.data.finetuning.prepare_finetuning_batch"] = "imported"
    micro, _ = prepare_finetuning_batch(iter(loader), num_microbatches=2, default_seq_length=256)
    handle = Handle()
    batches = list(ContextIterator(micro, handle))
    out["micro_batches"] = {"keys": [sorted(b) for b in batches], "samples": handle.seen}

    from megatron.bridge.training.losses import masked_next_token_loss

    objects["megatron.bridge.training.losses.masked_next_token_loss"] = "imported"
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss_fn = partial(masked_next_token_loss, mask, check_for_nan_in_loss=False)
    plain = loss_fn(torch.tensor([[2.0, 3.0, 9.0]]))

    class NoLoss:
        method = types.SimpleNamespace(loss=None)

        def report(self):
            return {}

    wrapped = anchored_loss(loss_fn, NoLoss(), torch.tensor([[2.0, 3.0, 9.0]]))
    out["loss"] = {"plain": [float(plain[0]), int(plain[1]), sorted(plain[2])],
                   "wrapped": [float(wrapped[0]), int(wrapped[1]), sorted(wrapped[2])]}  # fmt: skip


def _hash(item: dict) -> str:
    from rpb.data import Example

    return Example(item["sample_index"], list(item["input_ids"]), list(item["span_ids"])).token_sha256


def parsed_checks(line: str, root: Path, work: Path, out: dict) -> None:
    """What every line is checked on by reading its source: the recipe, the forward-step signature Bridge
    inspects, finetune's signature, the SFT dataset's constructor, the fields rpb sets."""
    objects = out["objects"]

    def how(module: str) -> str:
        if out["imports"]:
            _, blocker = try_import(module)
            return f"parsed ({blocker} at import)" if blocker else "imported"
        return "parsed (Python 3.12 line)"

    recipes = parse(root, "megatron/bridge/recipes/moonlight/__init__.py")
    exported = {a.asname or a.name for n in ast.walk(recipes) if isinstance(n, ast.ImportFrom) for a in n.names}
    out["recipe"] = {"moonlight_16b_sft_config exported": "moonlight_16b_sft_config" in exported}
    objects["megatron.bridge.recipes.moonlight.moonlight_16b_sft_config"] = how("megatron.bridge.recipes.moonlight")

    fin = function(parse(root, "megatron/bridge/training/finetune.py"), "finetune")
    out["finetune"] = params(fin)
    objects["megatron.bridge.training.finetune.finetune"] = how("megatron.bridge.training.finetune")

    step = function(parse(root, "megatron/bridge/training/gpt_step.py"), "forward_step")
    out["forward_step"] = params(step)
    objects["megatron.bridge.training.gpt_step.forward_step"] = how("megatron.bridge.training.gpt_step")

    utils_rel = "megatron/bridge/training/utils/train_utils.py"
    inject = function(parse(root, utils_rel), "needs_global_state_injection")
    # Bridge's own test of a forward step's signature, run on rpb's: its source, executed alone
    namespace = {"inspect": importlib.import_module("inspect"), "GlobalState": type("GlobalState", (), {})}
    exec(compile(ast.Module([inject], []), utils_rel, "exec"), namespace)
    from rpb.integrations.megatron.bridge import AnchoredForwardStep

    out["state_injected"] = namespace["needs_global_state_injection"](AnchoredForwardStep(None, None))
    objects["megatron.bridge.training.utils.train_utils.needs_global_state_injection"] = (
        how("megatron.bridge.training.utils.train_utils") + "; its function executed"
    )

    sft_rel = next(r for r in ("megatron/bridge/data/datasets/gpt_sft.py", "megatron/bridge/data/datasets/sft.py")
                   if (root / r).is_file())  # fmt: skip
    sft = next(n for n in ast.walk(parse(root, sft_rel)) if isinstance(n, ast.ClassDef) and n.name == "GPTSFTDataset")
    out["sft_dataset"] = {"module": sft_rel, "init": params(function(sft, "__init__"))}

    paths = json.loads((work / "paths.json").read_text())
    out["fields"] = field_report(root, paths["required"])
    out["contract_fields"] = field_report(root, paths["contract"])
    objects["megatron.bridge.training.config.ConfigContainer"] = how("megatron.bridge.training.config")


def main() -> None:
    line, root, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out: dict = {"line": line, "python": platform.python_version(), "objects": {}}
    imports = importlib.util.find_spec("torch") is not None and (root / "transformers").is_dir()
    out["imports"] = imports
    import transformers

    # v0.3.1: the folder's own 4.x; 0.6.2: only rpb's side (the signature check) runs, Bridge is read
    out["transformers"] = transformers.__version__
    if imports:
        imported_line(line, root, work, out)
    parsed_checks(line, root, work, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
