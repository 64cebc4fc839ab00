#!/usr/bin/env python3
"""Writes random-weight gemma3, phi3, qwen3moe and gpt-oss GGUFs with llama.cpp's own writer,
gguf-py (from the node-llama-cpp bundle: bench/peer/build.sh source), laid out and keyed as its
converters write them: tests/data/models/{gemma3,phi3,qwen3moe,gpt-oss}-gguf-py.gguf
(tests/data/models/README.md).

  PYTHONPATH=~/.cache/combs-peer/llama.cpp/gguf-py python3 tests/reference/write_gguf_py_models.py OUT_DIR

Q8_0 matrices (gguf-py's own quantizer), F32 norms. The 259-token byte vocabulary of
combs-mkmodel's files (plus <|endoftext|>, which llama.cpp's loader looks up in phi3 models).
gemma3 gives its window pattern as a per-layer bool array (as its converter does), phi3 fuses
Q/K/V and gate/up, rotates 48 of 64 dims and carries LongRoPE factors. The mixtures of experts
stack their experts in 3-D tensors [n_expert, out, in] with an F32 router: qwen3moe with q/k norms,
gpt-oss with its experts in MXFP4 (gguf-py's quantizer), biases on Q/K/V, the attention output,
the router and each expert, attention sinks, YaRN, every other layer windowed, and its FFN norm
stored as post_attention_norm (as convert_hf_to_gguf names it).
"""
import sys

import numpy as np

import gguf

rng = np.random.default_rng(2026)


def uniform(shape, std, center=0.0):
    half = std * np.sqrt(3.0)
    return (center + rng.uniform(-half, half, size=shape)).astype(np.float32)


def vocab(w, extra=()):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(extra)
    types = [2, 3, 3] + [6] * 256 + [3] * len(extra)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    return len(tokens)


def matrix(w, name, out, inp, std=None):
    data = uniform((out, inp), std if std is not None else 1.0 / np.sqrt(inp))
    w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def norm(w, name, n):
    w.add_tensor(name, uniform((n,), 0.1 / np.sqrt(3.0), 1.0))


def experts(w, name, n, out, inp, qtype=gguf.GGMLQuantizationType.Q8_0):
    data = uniform((n, out, inp), 1.0 / np.sqrt(inp))
    w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def bias(w, name, shape):
    w.add_tensor(name, uniform(shape, 0.1 / np.sqrt(3.0)))


def start(path, arch, e, layers, heads, kv, ff, hd=None, extra_tokens=()):
    """A writer with the keys every file shares, in its converter's order (key and value lengths
    where hd is given); returns the writer and the vocabulary's size."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"combs gguf-py random {arch}")
    n_vocab = vocab(w, extra_tokens)
    w.add_context_length(2048)
    w.add_embedding_length(e)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    if hd is not None:
        w.add_key_length(hd)
        w.add_value_length(hd)
    return w, n_vocab


def embeddings(w, n_vocab, e, std):
    matrix(w, "token_embd.weight", n_vocab, e, std=std)
    norm(w, "output_norm.weight", e)
    matrix(w, "output.weight", n_vocab, e)


def qkv(w, b, e, heads, kv, hd):
    matrix(w, b + "attn_q.weight", heads * hd, e)
    matrix(w, b + "attn_k.weight", kv * hd, e)
    matrix(w, b + "attn_v.weight", kv * hd, e)


def gemma3(path):
    e, layers, heads, kv, hd, ff = 128, 6, 2, 1, 64, 256
    w, n_vocab = start(path, "gemma3", e, layers, heads, kv, ff, hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_rope_freq_base_swa(1e4)
    w.add_sliding_window(8)
    w.add_sliding_window_pattern([i % 3 < 2 for i in range(layers)])  # 2 of 3 windowed
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    embeddings(w, n_vocab, e, 1.0 / np.sqrt(e))  # x sqrt(n_embd): std 1
    for i in range(layers):
        b = f"blk.{i}."
        norm(w, b + "attn_norm.weight", e)
        qkv(w, b, e, heads, kv, hd)
        norm(w, b + "attn_q_norm.weight", hd)
        norm(w, b + "attn_k_norm.weight", hd)
        matrix(w, b + "attn_output.weight", e, heads * hd)
        norm(w, b + "post_attention_norm.weight", e)
        norm(w, b + "ffn_norm.weight", e)
        matrix(w, b + "ffn_gate.weight", ff, e)
        matrix(w, b + "ffn_up.weight", ff, e)
        matrix(w, b + "ffn_down.weight", e, ff)
        norm(w, b + "post_ffw_norm.weight", e)
    finish(w)


def phi3(path):
    e, layers, heads, kv, hd, ff, rot = 128, 2, 2, 1, 64, 256, 48
    w, n_vocab = start(path, "phi3", e, layers, heads, kv, ff, extra_tokens=["<|endoftext|>"])
    w.add_rope_dimension_count(rot)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e4)
    w.add_rope_scaling_orig_ctx_len(2048)
    w.add_rope_scaling_attn_factors(1.19)
    w.add_tensor("rope_factors_long.weight", uniform((rot // 2,), 2.0, 5.0))
    w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 3.0, rot // 2, dtype=np.float32))
    embeddings(w, n_vocab, e, 1.0)
    for i in range(layers):
        b = f"blk.{i}."
        norm(w, b + "attn_norm.weight", e)
        matrix(w, b + "attn_qkv.weight", (heads + 2 * kv) * hd, e)
        matrix(w, b + "attn_output.weight", e, heads * hd)
        norm(w, b + "ffn_norm.weight", e)
        matrix(w, b + "ffn_up.weight", 2 * ff, e)
        matrix(w, b + "ffn_down.weight", e, ff)
    finish(w)


def qwen3moe(path):
    e, layers, heads, kv, hd, n_exp, used, ff = 128, 2, 4, 2, 64, 4, 2, 64
    w, n_vocab = start(path, "qwen3moe", e, layers, heads, kv, ff * used, hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(ff)
    embeddings(w, n_vocab, e, 1.0)
    for i in range(layers):
        b = f"blk.{i}."
        norm(w, b + "attn_norm.weight", e)
        qkv(w, b, e, heads, kv, hd)
        norm(w, b + "attn_q_norm.weight", hd)
        norm(w, b + "attn_k_norm.weight", hd)
        matrix(w, b + "attn_output.weight", e, heads * hd)
        norm(w, b + "ffn_norm.weight", e)
        w.add_tensor(b + "ffn_gate_inp.weight", uniform((n_exp, e), 1.0 / np.sqrt(e)))
        experts(w, b + "ffn_gate_exps.weight", n_exp, ff, e)
        experts(w, b + "ffn_up_exps.weight", n_exp, ff, e)
        experts(w, b + "ffn_down_exps.weight", n_exp, e, ff)
    finish(w)


def gpt_oss(path):
    e, layers, heads, kv, hd, n_exp, used, ff = 128, 2, 4, 1, 64, 4, 2, 64
    w, n_vocab = start(path, "gpt-oss", e, layers, heads, kv, ff, hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(512)
    w.add_sliding_window(8)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(ff)
    embeddings(w, n_vocab, e, 1.0)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    for i in range(layers):
        b = f"blk.{i}."
        norm(w, b + "attn_norm.weight", e)
        qkv(w, b, e, heads, kv, hd)
        bias(w, b + "attn_q.bias", (heads * hd,))
        bias(w, b + "attn_k.bias", (kv * hd,))
        bias(w, b + "attn_v.bias", (kv * hd,))
        matrix(w, b + "attn_output.weight", e, heads * hd)
        bias(w, b + "attn_output.bias", (e,))
        w.add_tensor(b + "attn_sinks.weight", uniform((heads,), 1.0, 0.5))
        norm(w, b + "post_attention_norm.weight", e)
        w.add_tensor(b + "ffn_gate_inp.weight", uniform((n_exp, e), 1.0 / np.sqrt(e)))
        bias(w, b + "ffn_gate_inp.bias", (n_exp,))
        experts(w, b + "ffn_gate_exps.weight", n_exp, ff, e, mxfp4)
        experts(w, b + "ffn_up_exps.weight", n_exp, ff, e, mxfp4)
        experts(w, b + "ffn_down_exps.weight", n_exp, e, ff, mxfp4)
        bias(w, b + "ffn_gate_exps.bias", (n_exp, ff))
        bias(w, b + "ffn_up_exps.bias", (n_exp, ff))
        bias(w, b + "ffn_down_exps.bias", (n_exp, e))
    finish(w)


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/data/models"
    gemma3(f"{out}/gemma3-gguf-py.gguf")
    phi3(f"{out}/phi3-gguf-py.gguf")
    qwen3moe(f"{out}/qwen3moe-gguf-py.gguf")
    gpt_oss(f"{out}/gpt-oss-gguf-py.gguf")
