#!/usr/bin/env python3
"""Compares combs' logits with Hugging Face transformers on the same GGUF weights.

Run where torch and transformers are installed (the GPU machine):
  compare_hf.py --gguf model.gguf --logits combs_logits.f32 --ids "1 2 3 ..."
The GGUF is read here with a small independent parser; llama's Q/K weights are un-permuted (the
inverse of llama.cpp's converter) so that transformers' rotate-half RoPE sees them as trained.
combs_logits.f32 is `combs-generate --logits-out` for the same prompt: [n_tokens, n_vocab] f32.
"""
import argparse
import struct
import sys

import numpy as np
import torch


def read_gguf(path):
    data = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def take(fmt):
        nonlocal pos
        size = struct.calcsize(fmt)
        vals = struct.unpack_from("<" + fmt, data, pos)
        pos += size
        return vals[0] if len(vals) == 1 else vals

    def string():
        n = take("Q")
        nonlocal pos
        s = bytes(data[pos:pos + n]).decode("utf-8", "replace")
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    assert bytes(data[:4]) == b"GGUF", "not a GGUF file"
    pos = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        nd = take("I")
        dims = [take("Q") for _ in range(nd)]
        infos.append((name, dims, take("I"), take("Q")))
    align = meta.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    tensors = {}
    for name, dims, ggml_type, off in infos:
        n = int(np.prod(dims))
        shape = list(reversed(dims))  # row-major [out, in]
        at = start + off
        if ggml_type == 0:
            arr = np.frombuffer(data, np.float32, n, at)
        elif ggml_type == 1:
            arr = np.frombuffer(data, np.float16, n, at).astype(np.float32)
        elif ggml_type == 30:
            arr = (np.frombuffer(data, np.uint16, n, at).astype(np.uint32) << 16).view(np.float32)
        elif ggml_type == 8:
            blocks = np.frombuffer(data, np.uint8, n // 32 * 34, at).reshape(-1, 34)
            d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
            arr = (q * d).reshape(-1)
        else:
            raise SystemExit(f"{name}: ggml type {ggml_type} not handled")
        tensors[name] = torch.from_numpy(arr.reshape(shape).copy())
    return meta, tensors


def unpermute(w, n_head):
    # llama.cpp: w.reshape(n_head, 2, d/2, in).swapaxes(1, 2); here the inverse.
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def experts(t, b, p, want):
    """Layer b's experts as transformers names them under p: the router and the experts in one of
    its layouts (per expert, or stacked [n_expert, out, in] with gate and up in one), the shared
    expert and its gate where the file has them. `want`: the model's names and shapes."""
    moe = next((p + m for m in ("mlp.", "block_sparse_moe.") if p + m + "gate.weight" in want), None)
    if moe is None:
        raise SystemExit(f"no router among {sorted(k for k in want if k.startswith(p))}")
    gate, up, down = t[b + "ffn_gate_exps.weight"], t[b + "ffn_up_exps.weight"], t[b + "ffn_down_exps.weight"]
    sd = {moe + "gate.weight": t[b + "ffn_gate_inp.weight"]}
    e = moe + "experts."
    if e + "gate_up_proj" in want:  # stacked, gate rows then up rows: [n_expert, 2 ff, in] (or transposed)
        gu = torch.cat([gate, up], dim=1)
        sd[e + "gate_up_proj"] = gu if want[e + "gate_up_proj"] == tuple(gu.shape) else gu.transpose(1, 2).contiguous()
        sd[e + "down_proj"] = down if want[e + "down_proj"] == tuple(down.shape) else down.transpose(1, 2).contiguous()
    elif e + "gate_proj" in want:
        sd.update({e + "gate_proj": gate, e + "up_proj": up, e + "down_proj": down})
    else:
        names = ("gate_proj", "up_proj", "down_proj") if e + "0.gate_proj.weight" in want else ("w1", "w3", "w2")
        if e + f"0.{names[0]}.weight" not in want:
            raise SystemExit(f"no experts among {sorted(k for k in want if k.startswith(moe))}")
        for i in range(gate.shape[0]):
            for n, w in zip(names, (gate, up, down)):
                sd[e + f"{i}.{n}.weight"] = w[i]
    if b + "ffn_gate_inp_shexp.weight" in t:
        for n in ("gate", "up", "down"):
            sd[moe + f"shared_expert.{n}_proj.weight"] = t[b + f"ffn_{n}_shexp.weight"]
        sd[moe + "shared_expert_gate.weight"] = t[b + "ffn_gate_inp_shexp.weight"].reshape(1, -1)
    return sd


def gpt_oss_experts(t, b, p, want):
    """Layer b's gpt-oss router and experts as transformers' GptOss holds them: gate and up in one
    stacked tensor, their output rows interleaved (gate, up, gate, ...) where its forward splits
    them with [..., ::2] (llama.cpp's converter de-interleaves them into ffn_gate/up_exps), biases
    beside. Whether the stacked tensors are [n_expert, in, out] (x @ W) or [n_expert, out, in] is read
    from down_proj's shape, and the interleaving from the forward's source, not assumed."""
    import inspect
    from transformers.models.gpt_oss import modeling_gpt_oss
    interleaved = "::2" in inspect.getsource(modeling_gpt_oss.GptOssExperts)
    m, e = p + "mlp.", p + "mlp.experts."
    gate, up, down = t[b + "ffn_gate_exps.weight"], t[b + "ffn_up_exps.weight"], t[b + "ffn_down_exps.weight"]
    gb, ub = t[b + "ffn_gate_exps.bias"], t[b + "ffn_up_exps.bias"]
    n_expert, ff, hidden = gate.shape
    if interleaved:
        gu = torch.stack([gate, up], dim=2).reshape(n_expert, 2 * ff, hidden)
        gub = torch.stack([gb, ub], dim=2).reshape(n_expert, 2 * ff)
    else:
        gu, gub = torch.cat([gate, up], dim=1), torch.cat([gb, ub], dim=1)
    x_at_w = want[e + "down_proj"] == (n_expert, ff, hidden)  # [n_expert, in, out]
    print(f"gpt-oss experts: gate/up {'interleaved' if interleaved else 'concatenated'}, "
          f"{'x @ W' if x_at_w else 'W x'}", file=sys.stderr)
    return {m + "router.weight": t[b + "ffn_gate_inp.weight"], m + "router.bias": t[b + "ffn_gate_inp.bias"],
            e + "gate_up_proj": gu.transpose(1, 2).contiguous() if x_at_w else gu, e + "gate_up_proj_bias": gub,
            e + "down_proj": down.transpose(1, 2).contiguous() if x_at_w else down,
            e + "down_proj_bias": t[b + "ffn_down_exps.bias"]}


def layer_windowed(meta, a, n_layers, pattern):
    """Which layers use the sliding window, as llama.cpp reads it (a number or a per-layer array)."""
    p = meta.get(a + "attention.sliding_window_pattern", pattern)
    if isinstance(p, list):
        return [bool(x) for x in p]
    return [p == 0 or i % p < p - 1 for i in range(n_layers)]


def build(meta, t):
    """The transformers model of the GGUF's architecture, its weights loaded from the GGUF tensors.
    Gemma: llama.cpp's converter stores every norm weight + 1 (transformers' Gemma RMSNorm
    multiplies by 1 + weight), so 1 is taken off here."""
    import transformers
    arch = meta["general.architecture"]
    a = arch + "."
    n_layers = meta[a + "block_count"]
    heads, kv = meta[a + "attention.head_count"], meta[a + "attention.head_count_kv"]
    hidden = meta[a + "embedding_length"]
    head_dim = meta.get(a + "attention.key_length", hidden // heads)
    common = dict(
        vocab_size=t["token_embd.weight"].shape[0], hidden_size=hidden,
        intermediate_size=meta[a + "feed_forward_length"], num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=meta[a + "attention.layer_norm_rms_epsilon"],
        rope_theta=meta[a + "rope.freq_base"], max_position_embeddings=meta[a + "context_length"],
        tie_word_embeddings="output.weight" not in t)
    scaling = meta.get(a + "rope.scaling.type")
    factor = meta.get(a + "rope.scaling.factor", 1.0)
    rope_scaling = None
    if scaling == "linear" and factor != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": factor}
    elif scaling == "yarn":
        # llama.cpp's magnitude: attn_factor * (1 + 0.1 ln factor); transformers' attention_factor
        # replaces its own (1 + 0.1 ln factor) when given.
        rope_scaling = {"rope_type": "yarn", "factor": factor,
                        "original_max_position_embeddings": meta[a + "rope.scaling.original_context_length"],
                        "attention_factor": meta.get(a + "rope.scaling.attn_factor", 1.0) * (1 + 0.1 * np.log(factor)),
                        "beta_fast": 32.0, "beta_slow": 1.0}
    if "rope_factors_short.weight" in t:  # LongRoPE (phi3), with llama.cpp's attention factor
        rope_scaling = {"rope_type": "longrope", "short_factor": t["rope_factors_short.weight"].tolist(),
                        "long_factor": t["rope_factors_long.weight"].tolist(),
                        "attention_factor": meta.get(a + "rope.scaling.attn_factor", 1.0)}
        common["original_max_position_embeddings"] = meta[a + "rope.scaling.original_context_length"]
    if rope_scaling:
        common["rope_scaling"] = rope_scaling
    gemma = arch in ("gemma2", "gemma3")
    n_expert = meta.get(a + "expert_count", 0)
    if n_expert:  # a mixture of experts in every layer
        ff_exp = meta.get(a + "expert_feed_forward_length", common["intermediate_size"])
        moe = dict(num_experts_per_tok=meta[a + "expert_used_count"])
        if arch == "llama":  # Mixtral: softmax over all, the top k renormalized
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
                **dict(common, intermediate_size=ff_exp), num_local_experts=n_expert, **moe))
        elif arch == "qwen3moe":  # llama.cpp renormalizes qwen3moe's top k (norm_topk_prob)
            model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                **common, num_experts=n_expert, moe_intermediate_size=ff_exp, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], **moe))
        elif arch == "gpt-oss":  # top k then softmax, clamped SwiGLU, sinks; even layers windowed
            windowed = layer_windowed(meta, a, n_layers, 2)
            model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
                **dict(common, intermediate_size=ff_exp), num_local_experts=n_expert, attention_bias=True,
                layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
                sliding_window=meta.get(a + "attention.sliding_window", 128), **moe))
        elif arch == "qwen2moe":  # not renormalized; a shared expert behind a sigmoid gate
            common.pop("head_dim")
            model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
                **common, num_experts=n_expert, moe_intermediate_size=ff_exp, norm_topk_prob=False,
                shared_expert_intermediate_size=meta[a + "expert_shared_feed_forward_length"],
                decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True, **moe))
        else:
            raise SystemExit(f"architecture {arch} with experts not handled")
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "qwen2":
        common.pop("head_dim")
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    elif arch == "phi3":
        rope_dim = meta.get(a + "rope.dimension_count", head_dim)
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, partial_rotary_factor=rope_dim / head_dim,
                                                                     pad_token_id=None))  # its default, 32000, is past a tiny vocabulary
    elif gemma:
        pattern = 2 if arch == "gemma2" else 6
        windowed = layer_windowed(meta, a, n_layers, pattern)
        extra = dict(query_pre_attn_scalar=head_dim, hidden_activation="gelu_pytorch_tanh",
                     layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
                     sliding_window=meta.get(a + "attention.sliding_window", 4096))
        if arch == "gemma2":
            extra.update(attn_logit_softcapping=meta.get(a + "attn_logit_softcapping", 50.0),
                         final_logit_softcapping=meta.get(a + "final_logit_softcapping", 30.0))
            model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, **extra))
        else:
            extra.update(final_logit_softcapping=meta.get(a + "final_logit_softcapping"),
                         rope_local_base_freq=meta.get(a + "rope.freq_base_swa", 10000.0))
            model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, **extra))
    else:
        raise SystemExit(f"architecture {arch} not handled")
    norm = (lambda w: w - 1.0) if gemma else (lambda w: w)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": norm(t["output_norm.weight"])}
    sd["lm_head.weight"] = t.get("output.weight", t["token_embd.weight"])
    for i in range(n_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        sd[p + "self_attn.o_proj.weight"] = t[b + "attn_output.weight"]
        if arch == "phi3":  # fused as transformers' Phi3 holds them: qkv_proj, gate_up_proj
            sd[p + "self_attn.qkv_proj.weight"] = t[b + "attn_qkv.weight"]
            sd[p + "mlp.gate_up_proj.weight"] = t[b + "ffn_up.weight"]
            sd[p + "mlp.down_proj.weight"] = t[b + "ffn_down.weight"]
            sd[p + "input_layernorm.weight"] = t[b + "attn_norm.weight"]
            sd[p + "post_attention_layernorm.weight"] = t[b + "ffn_norm.weight"]
            continue
        q, k = t[b + "attn_q.weight"], t[b + "attn_k.weight"]
        if arch == "llama":
            q, k = unpermute(q, heads), unpermute(k, kv)
        sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"] = q, k
        sd[p + "self_attn.v_proj.weight"] = t[b + "attn_v.weight"]
        if arch in ("qwen2", "qwen2moe"):
            for n in "qkv":
                sd[p + f"self_attn.{n}_proj.bias"] = t[b + f"attn_{n}.bias"]
        if b + "attn_q_norm.weight" in t:
            sd[p + "self_attn.q_norm.weight"] = norm(t[b + "attn_q_norm.weight"])
            sd[p + "self_attn.k_norm.weight"] = norm(t[b + "attn_k_norm.weight"])
        if arch == "gpt-oss":
            for n in "qkv":
                sd[p + f"self_attn.{n}_proj.bias"] = t[b + f"attn_{n}.bias"]
            sd[p + "self_attn.o_proj.bias"] = t[b + "attn_output.bias"]
            sd[p + "self_attn.sinks"] = t[b + "attn_sinks.weight"]
            sd.update(gpt_oss_experts(t, b, p, want))
            sd[p + "input_layernorm.weight"] = t[b + "attn_norm.weight"]
            sd[p + "post_attention_layernorm.weight"] = t[b + "post_attention_norm.weight"]
            continue
        if n_expert:
            sd.update(experts(t, b, p, want))
        else:
            sd[p + "mlp.gate_proj.weight"] = t[b + "ffn_gate.weight"]
            sd[p + "mlp.up_proj.weight"] = t[b + "ffn_up.weight"]
            sd[p + "mlp.down_proj.weight"] = t[b + "ffn_down.weight"]
        sd[p + "input_layernorm.weight"] = norm(t[b + "attn_norm.weight"])
        if gemma:
            sd[p + "post_attention_layernorm.weight"] = norm(t[b + "post_attention_norm.weight"])
            sd[p + "pre_feedforward_layernorm.weight"] = norm(t[b + "ffn_norm.weight"])
            sd[p + "post_feedforward_layernorm.weight"] = norm(t[b + "post_ffw_norm.weight"])
        else:
            sd[p + "post_attention_layernorm.weight"] = t[b + "ffn_norm.weight"]
    wrong = [f"{k} {tuple(v.shape)} (model {want[k]})" for k, v in sd.items() if k in want and tuple(v.shape) != want[k]]
    if wrong:
        raise SystemExit(f"shape mismatch: {wrong}")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary" not in m and not (m == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if "output.weight" not in t:
        model.tie_weights()
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--logits", required=True)
    ap.add_argument("--ids", required=True)
    args = ap.parse_args()
    ids = [int(x) for x in args.ids.split()]
    meta, tensors = read_gguf(args.gguf)
    model = build(meta, tensors)
    model.config._attn_implementation = "eager"  # softcapping and sliding windows as written
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(dev, torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids], device=dev)).logits[0].float().cpu().numpy()
    got = np.fromfile(args.logits, dtype=np.float32).reshape(len(ids), -1)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = np.abs(got - ref)
    scale = np.abs(ref).max()
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    corr = float(np.corrcoef(got.reshape(-1), ref.reshape(-1))[0, 1])
    print(f"{args.gguf}: {len(ids)} positions x {ref.shape[1]} logits; max |diff| {diff.max():.4g} "
          f"(logits up to {scale:.3g}; max rel {diff.max() / scale:.3g}), mean |diff| {diff.mean():.3g}, "
          f"argmax agreement {agree:.3f}, correlation {corr:.6f}")
    ok = agree >= 0.95 and corr > 0.999 and diff.max() / scale < 0.05
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
