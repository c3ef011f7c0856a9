"""GGUF -> transformers -> GGUF round trip: the exported model serves the same policy.

The unmodified SmolLM2 is loaded into PyTorch (dequantised Q4_1), saved, exported to an f16 GGUF and
served by llama.cpp; its logprobs for a greedy continuation are compared with the original Q4_1 GGUF's
and with PyTorch's own for the same tokens. The gaps are printed (run with -s to see them).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from openforge.engines.gguf import ExportError, export_gguf, llama_permute
from openforge.engines.llamacpp import EmbeddedEngine
from openforge.models import default_gguf, load_model

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def greedy(gguf, log) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, completion ids, completion logprobs) of a greedy continuation."""
    with EmbeddedEngine(gguf, threads=1, log_path=log) as eng:
        body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.0, "logprobs": True}
        choice = httpx.post(f"{eng.url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
        prompt = httpx.post(f"{eng.url}/apply-template", json={"messages": MESSAGES}, timeout=30).json()["prompt"]
        prompt_ids = httpx.post(f"{eng.url}/tokenize", json={"content": prompt, "parse_special": True},
                                timeout=30).json()["tokens"]
    content = choice["logprobs"]["content"]
    return prompt_ids, [e["id"] for e in content], [e["logprob"] for e in content]


@pytest.mark.timeout(900)
def test_engine_llamacpp_export_round_trip(tmp_path) -> None:
    model = load_model()
    saved = tmp_path / "hf"
    model.save_pretrained(saved)  # the GGUF quantizer marker is gone: saving works
    assert (saved / "model.safetensors").is_file()
    exported = export_gguf(model.state_dict(), default_gguf(), tmp_path / "smollm2-f16.gguf")
    assert exported.is_file() and not list(tmp_path.glob("*.partial"))

    prompt, ids_q, lp_q = greedy(default_gguf(), tmp_path / "q.log")
    prompt_f, ids_f, lp_f = greedy(exported, tmp_path / "f.log")
    assert prompt_f == prompt
    common = next((i for i, (a, b) in enumerate(zip(ids_q, ids_f)) if a != b), min(len(ids_q), len(ids_f)))
    assert common >= 4, (ids_q, ids_f)
    gap_q = np.abs(np.array(lp_f[:common]) - np.array(lp_q[:common]))

    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids_f])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    torch_lp = np.array([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids_f)])
    gap_torch = np.abs(torch_lp - np.array(lp_f))
    print(f"\nexported f16 vs original Q4_1: max {gap_q.max():.4f} mean {gap_q.mean():.4f} nats over {common} tokens")
    print(f"exported f16 vs PyTorch fp32: max {gap_torch.max():.4f} mean {gap_torch.mean():.4f} nats "
          f"over {len(ids_f)} tokens")
    # The export itself is exact up to f16 rounding; the Q4_1 file differs more because llama.cpp also
    # quantises activations (Q8_1) in Q4_1 matmuls.
    assert gap_torch.max() < 0.05
    assert gap_q.mean() < 0.1


def test_engine_llamacpp_permute_is_llamacpp_layout() -> None:
    """Row order per head: llama.cpp interleaves the two rotary halves (0, h, 1, h+1, ...)."""
    w = np.arange(8, dtype=np.float32)[:, None]  # one head of dim 8, rows 0..7
    assert llama_permute(w, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_engine_llamacpp_export_rejects_foreign_checkpoint(tmp_path) -> None:
    with pytest.raises(ExportError, match="no llama.cpp name|does not match"):
        export_gguf({"model.embed_tokens.weight": torch.zeros(10, 4)}, default_gguf(), tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())
