"""One decoding step of the `hf-fast` rollout, taken apart: where its time goes, and how much any
engine could still take from it (issue 31's one-thread goal).

    python bench/decode_step_bench.py                                    # pi_SFT's shape, random weights
    python bench/decode_step_bench.py --checkpoint runs/_shared/sft --keys 60 300 600

At --rows rows whose caches hold --keys positions (one thread unless --threads), it times:
- `hf`: `Decoder.step` (support/fast_rollout.py), the model's own forward, as `hf-fast` runs it;
- `ops`: the same step as the fewest torch operators on the model's own weights (q/k/v and
  gate/up fused into one projection each, no module's Python): what a decode loop outside the
  modules would save. Its logits are checked against `hf`'s (the largest difference is printed).
  It exists here only to be timed: the rollout keeps the modules;
- `sdpa`: the step's attention alone (SDPA over every layer's cache, as `hf-fast` calls it), in
  fp32 and, for comparison, in bf16 (a K/V cache of half the bytes);
- `matmul`: the step's projections and head alone, as in `ops`;
- `sample`: drawing the next tokens from the logits (`sample_tokens`, temperature 1, top-p 1).
Times are the median of --repeats timings of 20 steps each.

The bound. No engine that keeps the weights and the K/V cache in fp32 can take a step in less than
its matmul FLOPs at the machine's matmul rate on these shapes (rollout_bench.matmul_flops_per_s)
plus its K/V bytes (rows x layers x 2 x kv_heads x head_dim x 4 x keys) at the machine's read
bandwidth for that many bytes (a sum over a tensor of the K/V's size, fastest of 3: a K/V that fits
in the processor's last-level cache is read from there, as each step reads it again): it ignores
every other operator and sampling,
and assumes the two never wait on each other. best_speedup = hf / bound is the most any engine
could gain over `hf-fast` at that context. The last line, per --keys:
    decode keys=<k> hf_ms=<a> ops_ms=<b> sdpa_ms=<c> matmul_ms=<d> bound_ms=<e> best_speedup=<a/e> kv_read_gb_per_s=<r>
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from rollout_bench import MODELS, matmul_flops_per_s


def timed_ms(step, repeats: int, steps: int = 20) -> float:
    """Median over `repeats` of the mean time of `steps` calls of step(), after one warm-up call."""
    step()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        timings.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(timings)


def read_bytes_per_s(nbytes: int = 2**28) -> float:
    """The machine's read bandwidth for `nbytes`: bytes of an fp32 tensor that size summed per
    second, fastest of 3 (after a first sum, which brings it into whatever cache holds it)."""
    data = torch.ones(max(nbytes // 4, 1))
    data.sum()
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        data.sum()
        timings.append(time.perf_counter() - start)
    return data.numel() * data.element_size() / min(timings)


class OperatorStep:
    """The decoding step of a Qwen2-style model (RMSNorm, rotary positions, grouped-query
    attention, a SwiGLU MLP) as bare torch operators on the model's weights, over a `Decoder`'s
    cache: the same arithmetic as `Decoder.step`, without the modules around it."""

    def __init__(self, model, decoder):
        cfg = model.config
        if cfg.hidden_act != "silu":
            raise ValueError(f"OperatorStep writes a SiLU MLP; this model's is {cfg.hidden_act}")
        self.model, self.decoder = model, decoder
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.inner = model.model.layers[0].self_attn.head_dim, cfg.intermediate_size
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            biases = [p.bias if p.bias is not None else p.weight.new_zeros(len(p.weight))
                      for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
            self.layers.append(dict(
                qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv_bias=torch.cat(biases),
                o=attn.o_proj.weight, gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=mlp.down_proj.weight, norm_in=layer.input_layernorm, norm_post=layer.post_attention_layernorm))

    @staticmethod
    def _norm(x, norm):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits [rows, V] after `tokens` [rows], written at the cache's last position
        (the position `Decoder.step` wrote last, so that both can be timed over and over)."""
        model, decoder = self.model, self.decoder
        rows, length = len(tokens), decoder.cache.get_seq_length()
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = model.model.embed_tokens.weight[tokens]
        cos, sin = model.model.rotary_emb(h, decoder.positions - 1)  # the model's own rotary embedding
        cos, sin = cos[:, 0, None], sin[:, 0, None]  # [rows, 1, head_dim]: one position, every head
        bias = decoder.key_bias[..., :length]

        def rotate(x):
            first, second = x.chunk(2, -1)
            return x * cos + torch.cat([-second, first], -1) * sin

        for w, layer in zip(self.layers, decoder.cache.layers):
            qkv = torch.addmm(w["qkv_bias"], self._norm(h, w["norm_in"]), w["qkv"].t())
            q = rotate(qkv[:, :q_size].view(rows, self.heads, self.head_dim))
            layer.keys[:rows, :, length - 1] = rotate(qkv[:, q_size : q_size + kv_size].view(rows, self.kv_heads, self.head_dim))
            layer.values[:rows, :, length - 1] = qkv[:, q_size + kv_size :].view(rows, self.kv_heads, self.head_dim)
            attended = F.scaled_dot_product_attention(q[:, :, None], layer.keys[:rows, :, :length], layer.values[:rows, :, :length],
                                                      attn_mask=bias, enable_gqa=self.heads != self.kv_heads)
            h = h + attended.reshape(rows, q_size) @ w["o"].t()
            gate, up = (self._norm(h, w["norm_post"]) @ w["gate_up"].t()).split(self.inner, -1)
            h = h + (F.silu(gate) * up) @ w["down"].t()
        return model.model.norm(h) @ model.lm_head.weight.t()


def measure(model, rows: int, keys: int, repeats: int, rate: float) -> dict:
    """Time one decoding step at `rows` rows and `keys` cached positions (module docstring)."""
    from support.fast_rollout import Decoder, sample_tokens

    cfg, vocab = model.config, model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (rows, keys - 1), generator=generator)
    decoder = Decoder(model, prompts, torch.ones_like(prompts), max_new_tokens=1)
    tokens = torch.randint(0, vocab, (rows,), generator=generator)

    def hf_step():  # every call decodes at `keys`: a position written before is taken back first
        if decoder.cache.get_seq_length() == keys:
            for layer in decoder.cache.layers:
                layer.length = keys - 1
            decoder.positions = decoder.positions - 1
        return decoder.step(tokens)

    hf_logits = hf_step()
    ops = OperatorStep(model, decoder)
    difference = (ops(tokens) - hf_logits).abs().max().item()
    layers, head_dim = decoder.cache.layers, ops.head_dim
    query = torch.randn(rows, ops.heads, 1, head_dim, generator=generator)
    bias = decoder.key_bias[..., :keys]

    def attention(dtype):
        cached = [(layer.keys[:, :, :keys].to(dtype), layer.values[:, :, :keys].to(dtype)) for layer in layers]
        q, b = query.to(dtype), bias.to(dtype)
        return lambda: [F.scaled_dot_product_attention(q, k, v, attn_mask=b, enable_gqa=ops.heads != ops.kv_heads)
                        for k, v in cached]

    x = torch.randn(rows, cfg.hidden_size, generator=generator)
    inner = torch.randn(rows, cfg.intermediate_size, generator=generator)
    attended = torch.randn(rows, ops.heads * head_dim, generator=generator)

    def matmuls():
        for w in ops.layers:
            torch.addmm(w["qkv_bias"], x, w["qkv"].t())
            torch.mm(attended, w["o"].t())
            torch.mm(x, w["gate_up"].t())
            torch.mm(inner, w["down"].t())
        torch.mm(x, model.lm_head.weight.t())

    with torch.no_grad():
        result = {
            "hf": timed_ms(hf_step, repeats), "ops": timed_ms(lambda: ops(tokens), repeats),
            "sdpa": timed_ms(attention(torch.float32), repeats), "sdpa_bf16": timed_ms(attention(torch.bfloat16), repeats),
            "matmul": timed_ms(matmuls, repeats),
            "sample": timed_ms(lambda: sample_tokens(hf_logits, 1.0, 1.0, generator), repeats),
        }
    flops = 2 * rows * sum(w.numel() for layer in ops.layers for k, w in layer.items() if k in ("qkv", "o", "gate_up", "down"))
    flops += 2 * rows * model.lm_head.weight.numel()
    kv_bytes = rows * len(layers) * 2 * ops.kv_heads * head_dim * 4 * keys
    kv_read_s = kv_bytes / read_bytes_per_s(kv_bytes)
    bound = (flops / rate + kv_read_s) * 1e3
    return result | {"bound": bound, "kv_read_s": kv_read_s, "difference": difference, "flops": flops, "kv_bytes": kv_bytes}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a Hugging Face checkpoint (default: a random model of pi_SFT's shape)")
    parser.add_argument("--rows", type=int, default=64, help="rows still decoding")
    parser.add_argument("--keys", type=int, nargs="+", default=[60, 300, 600], help="cached positions a row attends to")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.checkpoint:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    else:
        from support.task import build_tokenizer, make_tiny_model

        model = make_tiny_model(build_tokenizer(), seed=0, **MODELS["sft"])
    model.eval()
    rate = matmul_flops_per_s(model.config, args.rows)
    print(f"machine: matmul {rate / 1e9:.0f} GFLOP/s on this model's shapes at {args.rows} rows, read "
          f"{read_bytes_per_s() / 1e9:.1f} GB/s over 256 MB; {args.threads} thread(s)")
    print(f"{'keys':>5} {'hf ms':>7} {'ops ms':>7} {'sdpa ms':>8} {'bf16 sdpa':>10} {'matmul ms':>10} {'sample ms':>10} "
          f"{'bound ms':>9} {'ops vs hf':>10} {'max |dlogit|':>13}")
    results = []
    for keys in args.keys:
        r = measure(model, args.rows, keys, args.repeats, rate)
        print(f"{keys:>5} {r['hf']:>7.2f} {r['ops']:>7.2f} {r['sdpa']:>8.2f} {r['sdpa_bf16']:>10.2f} {r['matmul']:>10.2f} "
              f"{r['sample']:>10.2f} {r['bound']:>9.2f} {r['hf'] / r['ops']:>9.2f}x {r['difference']:>13.1e}")
        results.append(r | {"keys": keys})
    for r in results:
        print(f"decode keys={r['keys']} hf_ms={r['hf']:.2f} ops_ms={r['ops']:.2f} sdpa_ms={r['sdpa']:.2f} "
              f"matmul_ms={r['matmul']:.2f} bound_ms={r['bound']:.2f} best_speedup={r['hf'] / r['bound']:.2f} "
              f"kv_read_gb_per_s={r['kv_bytes'] / r['kv_read_s'] / 1e9:.1f}")
    return results


if __name__ == "__main__":
    main()
