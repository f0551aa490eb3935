"""Mutants of the family matrix and of the shipped replicas: bugs that sit where a family differs from
Qwen3-MoE, each caught by tests/project/test_family_matrix.py on the family it concerns (issue 48), and replicas
built with the wrong template or config (tests/testing/test_replicas.py, tests/adapters/test_hf_replicas.py);
joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MATRIX = "tests/project/test_family_matrix.py"
REPLICA = "tests/testing/test_replicas.py::test_each_replica_carries_its_vendor_template_and_loads_as_a_checkpoint"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="matrix_monitor_softmax_on_sigmoid_families",
        story="the monitor reads every family's KL as softmax: on DeepSeek-V3 and GLM-4.5 it shows another "
        "quantity than the normalised sigmoid their routers score with",
        path="monitor/routing.py",
        function="RoutingMonitor._transform",
        pattern=r"return own or anchor or family_transform\(self\.facts\.score_function\)",
        replacement='return own or anchor or "softmax"',
        tests=(
            f"{MATRIX}::test_the_monitor_reads_moved_routers_as_a_hand_computation[deepseek_v3]",
            f"{MATRIX}::test_the_monitor_reads_moved_routers_as_a_hand_computation[glm4_5_air]",
        ),
    ),
    Mutant(
        name="matrix_monitor_base_without_the_router_bias",
        story="the monitor's frozen base router drops the router's own bias: on gpt-oss the base's logits and "
        "choices are not the base's",
        path="monitor/routing.py",
        function="RoutingMonitor._frozen",
        pattern=r"bias = getattr\(router, self\.facts\.router_bias\) if self\.facts\.router_bias else None",
        replacement="bias = None",
        tests=(f"{MATRIX}::test_the_monitor_reads_moved_routers_as_a_hand_computation[gpt_oss_20b]",),
    ),
    Mutant(
        name="matrix_expert_biases_escape_the_mask",
        story="only the fused expert weights follow the expert mask: gpt-oss's per-expert biases follow "
        "non_expert_modules instead",
        path="experts/masks.py",
        function="routed_expert_parameter",
        pattern=r"\\\.\(\.\+\)\$",
        replacement=r"\\.((?:gate_up|down)_proj)$",
        tests=(f"{MATRIX}::test_expert_training_moves_the_chosen_experts_alone[gpt_oss_20b]",),
    ),
    Mutant(
        name="replica_one_template_for_every_family",
        story="rpb.testing.replica saves every family with ChatML (Qwen3's template): gpt-oss and Kimi-K2 replicas "
        "no longer carry their vendor's template",
        path="testing/replicas.py",
        function="replica",
        pattern=r"tok = vendor_tokenizer\(fam\.template\)",
        replacement='tok = vendor_tokenizer("qwen3")',
        tests=(f"{REPLICA}[gpt_oss_20b]", f"{REPLICA}[kimi_k2]"),
    ),
    Mutant(
        name="replica_template_read_back_in_text_mode",
        story="the replica's template is saved as chat_template.jinja, which transformers reads in text mode: "
        "Kimi-K2's CRLF line ends come back as LF",
        path="testing/replicas.py",
        function="replica",
        pattern=r"tok\.save_pretrained\(out, save_jinja_files=False\)",
        replacement="tok.save_pretrained(out)",
        tests=(f"{REPLICA}[kimi_k2]",),
    ),
    Mutant(
        name="replica_vocab_of_the_vendor_tokenizer_alone",
        story="the replica's embedding has the vendor tokenizer's size: Qwen3.5's own tokenizer class adds "
        "an end-of-text token on load, an id with no embedding row",
        path="testing/replicas.py",
        function="replica",
        pattern=r"if loaded > len\(tok\):",
        replacement="if False:",
        tests=(f"{REPLICA}[qwen3_5_moe]",),
    ),
    Mutant(
        name="replica_dense_first_layers_not_counted",
        story="a replica keeps two layers whatever its dense-first count: DeepSeek-V3's (three dense layers first) "
        "has no MoE layer left",
        path="testing/replicas.py",
        function="_shrunk_text",
        pattern=r'layers = int\(real\.get\("first_k_dense_replace"\) or 0\) \+ 2',
        replacement="layers = 2",
        tests=(
            "tests/adapters/test_hf_replicas.py::test_each_replica_keeps_the_published_routing_values[deepseek_v3]",
        ),
    ),
)
