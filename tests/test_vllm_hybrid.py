"""Row chunking as it runs inside vLLM's worker (engines/vllm/hybrid.py), on real torch modules
shaped like vLLM's: an MLP, a linear returning (out, bias), an in-place fused add + norm and a
rotary embedding over non-contiguous q/k views. No vLLM needed (the real one: test_vllm_engine.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from batchscore.engines.vllm.hybrid import RowChunked  # noqa: E402


def test_an_mlp_runs_in_row_chunks_with_the_same_result():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=88)).eval()
    x = torch.randn(50, 32)  # [T, hidden], the layout vLLM passes
    calls = []
    mlp.down_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    with torch.inference_mode():
        expected = mlp(x)
        calls.clear()
        got = RowChunked(mlp.forward, 16)(x)
        assert calls == [16, 16, 16, 2]
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        calls.clear()
        RowChunked(mlp.forward, 16)(x[None])  # [1, T, hidden]: one row, run whole
        assert calls == [1]
    with pytest.raises(ValueError, match="at least 1"):
        from batchscore.engines.vllm.hybrid import chunk_rowwise

        chunk_rowwise(mlp, 0)


def test_a_linear_keeps_its_bias_output_whole():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 16, bias=False)
    bias = torch.randn(16)  # as many entries as a chunk has rows: still not rows

    def forward(x):  # vLLM linears return (out, bias)
        return linear(x), bias

    x = torch.randn(40, 8)
    out, got_bias = RowChunked(forward, 16, not_rows=(1,))(x)
    assert got_bias is bias
    torch.testing.assert_close(out, linear(x).detach())


def test_an_in_place_fused_add_norm_writes_into_its_inputs():
    torch.manual_seed(0)
    weight = torch.randn(8)

    def fused_add_norm(x, residual):  # vLLM's CPU kernel: residual += x; x = norm(residual) * w, in place
        residual.add_(x)
        x.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * weight)
        return x, residual

    x, residual = torch.randn(37, 8), torch.randn(37, 8)
    expected = fused_add_norm(x.clone(), residual.clone())
    got = RowChunked(fused_add_norm, 10)(x, residual)
    assert got[0] is x and got[1] is residual  # no [T, hidden] copy
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])


def test_a_norm_writes_its_fused_add_results_over_its_inputs():
    """A norm's (x, residual) form may run in place in vLLM (no caller reads its inputs after), so
    an out-of-place one writes its chunks' results over its inputs: no [T, hidden] outputs beside
    them. With x alone, the caller still holds x (as its residual): the result gets rows of its own."""
    torch.manual_seed(0)
    weight = torch.randn(8)

    def norm(x, residual=None):  # out of place, as vLLM's native fused add + norm
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        return out if residual is None else (out, residual)

    x, residual = torch.randn(37, 8), torch.randn(37, 8)
    expected = norm(x.clone(), residual.clone())
    got = RowChunked(norm, 10, into_inputs=True)(x, residual)
    assert got[0] is x and got[1] is residual
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    alone = torch.randn(37, 8)
    kept = alone.clone()
    out = RowChunked(norm, 10, into_inputs=True)(alone)
    assert out is not alone and torch.equal(alone, kept)
    torch.testing.assert_close(out, norm(kept))


def test_rotary_over_non_contiguous_q_k_views():
    torch.manual_seed(0)
    qkv = torch.randn(45, 3 * 16)
    q, k, _ = qkv.split([16, 16, 16], dim=-1)

    def rotary(positions, query, key):  # a rotation by position, out of place
        angle = positions[:, None].float() * 0.1
        return query * torch.cos(angle) + query.flip(-1) * torch.sin(angle), key * torch.cos(angle)

    positions = torch.arange(100, 145)
    expected = rotary(positions, q, k)
    got = RowChunked(rotary, 16)(positions, q, k)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])


def test_a_self_attention_block_builds_q_k_v_in_chunks_with_the_same_result():
    """`ChunkedSelfAttention` on a block laid out as vLLM's LlamaAttention (qkv_proj -> split ->
    rotary -> attention -> o_proj, linears returning (out, bias)): same output, projections run
    in chunks, attention once over the whole step."""
    from batchscore.engines.vllm.hybrid import ChunkedSelfAttention

    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8

    class Linear(torch.nn.Linear):
        def forward(self, x):
            self.rows.append(x.shape[0])
            return super().forward(x), None

    class Block(torch.nn.Module):
        q_size, kv_size = heads * dim, kv_heads * dim

        def __init__(self):
            super().__init__()
            self.qkv_proj, self.o_proj = Linear(32, self.q_size + 2 * self.kv_size), Linear(self.q_size, 32)
            self.qkv_proj.rows, self.o_proj.rows, self.attended = [], [], []

        def rotary_emb(self, positions, q, k):
            angle = positions[:, None].float() * 0.01
            return q * torch.cos(angle), k * torch.cos(angle) + k.flip(-1) * torch.sin(angle)

        def attn(self, q, k, v):
            self.attended.append(q.shape[0])
            q, k, v = (t.view(t.shape[0], -1, dim).transpose(0, 1) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out.transpose(0, 1).reshape(q.shape[1], -1)

        def forward(self, positions, hidden_states):
            qkv, _ = self.qkv_proj(hidden_states)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary_emb(positions, q, k)
            output, _ = self.o_proj(self.attn(q, k, v))
            return output

    block = Block()
    positions, hidden = torch.arange(70), torch.randn(70, 32)
    with torch.inference_mode():
        expected = block(positions, hidden)
        block.qkv_proj.rows.clear(), block.o_proj.rows.clear(), block.attended.clear()
        got = ChunkedSelfAttention(block, block.forward, 32)(positions, hidden)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert block.qkv_proj.rows == [32, 32, 6] and block.o_proj.rows == [32, 32, 6] and block.attended == [70]
