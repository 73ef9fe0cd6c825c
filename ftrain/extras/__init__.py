"""The extras: everything optional, built on the core's public names only.

HF fine-tuning recipes (`sft`, `lora`, `generation`, `preference`, `hf_export`,
`chunked_loss` and its GPU kernels), the `torch.func` research path (`func`), logging sinks and
trackers (`logging`), the loss-spike `guard`, `testing` helpers and the CLI (`cli`). Reach them
as `ft.sft`, `ft.func`, ... : `ftrain/__init__.py` imports each on first use.

The rule (CONTRIBUTING.md, enforced by tests/test_layout.py): extras import the core, never
the other way round, and only through the core's public names.
"""
