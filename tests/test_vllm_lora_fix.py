"""vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`, what `punica_cpu` runs) with omnid's fix
(`vllm_compat.fix_cpu_lora_no_adapter`): a token of no adapter (index -1) gets no LoRA term, as the
GPU kernels give it, and a token of an adapter gets its own. In-process, on small tensors.
"""

from __future__ import annotations

import pytest

from omnid.engines import vllm_compat

pytestmark = pytest.mark.vllm

torch = pytest.importorskip("torch")
lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")


def _weights(slots: int, out: int, inp: int, seed: int) -> object:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, 1, out, inp, generator=g)


def test_a_token_of_no_adapter_gets_no_lora_term_and_the_others_their_own() -> None:
    unfixed_shrink = lora_ops.bgmv_shrink
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    a = _weights(2, 3, 8, 1)            # 2 adapter slots, rank 3, in 8
    b = _weights(2, 5, 3, 2)            # out 5
    indices = torch.tensor([-1, 0, 1, -1])
    # what vLLM's ops do unfixed: index -1 reads the last slot
    wrong = torch.zeros(4, 3)
    unfixed_shrink(x, a, wrong, indices, 1.0)
    assert torch.allclose(wrong[0], a[1, 0] @ x[0])
    assert vllm_compat.fix_cpu_lora_no_adapter()
    assert vllm_compat.fix_cpu_lora_no_adapter()        # idempotent
    buffer = torch.full((4, 3), 9.0)
    lora_ops.bgmv_shrink(x, a, buffer, indices, 1.0)
    # shrink alone: a token of no adapter gets a zero row (whatever the buffer held), the others their own
    assert torch.equal(buffer[0], torch.zeros(3)) and torch.equal(buffer[3], torch.zeros(3))
    assert torch.allclose(buffer[1], a[0, 0] @ x[1], atol=1e-5) and torch.allclose(buffer[2], a[1, 0] @ x[2], atol=1e-5)
    y = torch.ones(4, 5)
    lora_ops.bgmv_expand(buffer, b, y, indices, True)
    for row, slot in enumerate(indices.tolist()):
        want = torch.ones(5) if slot < 0 else torch.ones(5) + b[slot, 0] @ (a[slot, 0] @ x[row])
        assert torch.allclose(y[row], want, atol=1e-5), (row, slot)
    # a batch of no adapter at all: nothing added, the buffer zero
    y = torch.ones(4, 5)
    none = torch.tensor([-1, -1, -1, -1])
    lora_ops.bgmv_shrink(x, a, buffer, none, 1.0)
    lora_ops.bgmv_expand(buffer, b, y, none, True)
    assert torch.equal(y, torch.ones(4, 5)) and torch.equal(buffer, torch.zeros(4, 3))
    # the slice variant writes only its slice, and only for tokens of an adapter
    y = torch.zeros(4, 9)
    lora_ops.bgmv_expand_slice(buffer.fill_(1.0), b, y, indices, 2, 5, True)
    assert torch.equal(y[0], torch.zeros(9)) and torch.equal(y[3], torch.zeros(9))
    assert torch.allclose(y[1, 2:7], b[0, 0] @ torch.ones(3)) and torch.equal(y[1, :2], torch.zeros(2))
