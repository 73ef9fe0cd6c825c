"""Which HF causal-LM types keep a packed row's examples apart: the measurement behind
`ftrain.losses._PACKING_LEAKS`.

`python tests/workers/packing_scan.py [MODEL_TYPE ...]` builds a tiny model of each type
(every causal-LM type transformers knows, by default; a few minutes) and prints one line per
type: "leaks", "honours", or why it could not be measured. Re-run it when transformers moves
and update the list; tests/test_task_losses.py measures a sample with the same functions.
"""

from __future__ import annotations

import signal
import sys

import torch

TINY = dict(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, ffn_dim=64, vocab_size=64, max_position_embeddings=64, head_dim=8,
    d_model=32, attention_heads=4, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0, use_cache=False,
)  # fmt: skip
# Two examples packed in one row (position_ids restart), and the second alone.
PACKED_IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
PACKED_POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
SECOND = torch.tensor([[9, 10, 11]])


def tiny_causal_lm(model_type: str) -> torch.nn.Module:
    """A tiny, dropout-free model of `model_type` from its default config, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type)
    for key, value in TINY.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def leaks(model: torch.nn.Module) -> bool:
    """Whether the second example's logits in the packed row differ from it run alone."""
    with torch.no_grad():
        packed = model(input_ids=PACKED_IDS, position_ids=PACKED_POSITIONS).logits
        alone = model(input_ids=SECOND).logits
    return not torch.allclose(packed[0, 4:], alone[0], atol=1e-4)


def _measure(model_type: str) -> str:
    import inspect

    model = tiny_causal_lm(model_type)
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "takes no position_ids"
    return "leaks" if leaks(model) else "honours"


def main(argv: list[str]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def slow(*_: object) -> None:
        raise TimeoutError("over 20 s")

    signal.signal(signal.SIGALRM, slow)
    for model_type in argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        signal.alarm(20)
        try:
            verdict = _measure(model_type)
        except Exception as e:  # a type that does not build from its default config
            verdict = f"not measured: {type(e).__name__}: {str(e)[:80]}"
        finally:
            signal.alarm(0)
        print(model_type, verdict, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
