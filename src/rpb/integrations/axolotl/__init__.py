"""rpb in axolotl: ``plugins: [rpb.integrations.axolotl.RpbPlugin]`` and an ``rpb:`` block in the YAML.

``RpbPlugin`` is imported on first use (it imports axolotl); ``rpb.integrations.axolotl.config`` is pure.
"""


def __getattr__(name: str):
    # axolotl's load_plugin does getattr(module, "RpbPlugin"): axolotl is imported only then
    if name in ("RpbPlugin", "TESTED_AXOLOTL"):
        from rpb.integrations.axolotl import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
