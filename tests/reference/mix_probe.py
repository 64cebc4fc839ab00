#!/usr/bin/env python3
"""Makes tests/data/quant/mixes.txt: which type llama.cpp's llama-quantize gives each tensor of two
probe models for each of its file types (the reference of combs' quant_mix.h). Not run by the tests.

usage: PYTHONPATH=LLAMA_CPP/gguf-py mix_probe.py LLAMA_QUANTIZE DIR > tests/data/quant/mixes.txt
Probe a: llama, n_embd 256, n_ff 512, 16 layers, 4 query heads on 1 KV head, output tied to
token_embd. Probe b: n_embd 320 (rows that are not whole 256-element blocks), n_ff 512, 16 layers,
5 heads on 5 KV heads, its own output. F16 random weights written by gguf-py (llama.cpp's own
writer); lines "probe type tensor ggml_type", F32 tensors left out.
"""
import os, subprocess, sys
import numpy as np
import gguf

TYPES = ['Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0', 'Q2_K', 'Q3_K_M', 'Q4_K_M', 'Q5_K_M', 'Q6_K', 'IQ4_NL', 'IQ4_XS']

def make(path, n_embd, n_ff, n_layer, n_head, n_kv, tied, vocab=300):
    w = gguf.GGUFWriter(path, 'llama')
    w.add_context_length(256); w.add_embedding_length(n_embd); w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff); w.add_head_count(n_head); w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5); w.add_rope_dimension_count(n_embd // n_head); w.add_file_type(1)
    w.add_tokenizer_model('llama')
    w.add_token_list([f'<t{i}>'.encode() for i in range(vocab)])
    w.add_token_scores([0.0]*vocab); w.add_token_types([1]*vocab)
    rng = np.random.default_rng(0)
    def t(name, shape):  # shape in numpy order (rows, cols) = (ne1, ne0)
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float16))
    t('token_embd.weight', (vocab, n_embd))
    w.add_tensor('output_norm.weight', np.ones(n_embd, dtype=np.float32))
    if not tied: t('output.weight', (vocab, n_embd))
    hd = n_embd // n_head
    for i in range(n_layer):
        w.add_tensor(f'blk.{i}.attn_norm.weight', np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f'blk.{i}.ffn_norm.weight', np.ones(n_embd, dtype=np.float32))
        t(f'blk.{i}.attn_q.weight', (n_head*hd, n_embd)); t(f'blk.{i}.attn_k.weight', (n_kv*hd, n_embd))
        t(f'blk.{i}.attn_v.weight', (n_kv*hd, n_embd)); t(f'blk.{i}.attn_output.weight', (n_embd, n_head*hd))
        t(f'blk.{i}.ffn_gate.weight', (n_ff, n_embd)); t(f'blk.{i}.ffn_up.weight', (n_ff, n_embd))
        t(f'blk.{i}.ffn_down.weight', (n_embd, n_ff))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
quantize, out = sys.argv[1], sys.argv[2]
make(f'{out}/a.gguf', 256, 512, 16, 4, 1, True)
make(f'{out}/b.gguf', 320, 512, 16, 5, 5, False)
for p in ['a', 'b']:
    for t in TYPES:
        q = f'{out}/{p}-{t}.gguf'
        subprocess.run([quantize, f'{out}/{p}.gguf', q, t, '2'], check=True, capture_output=True)
        for tensor in gguf.GGUFReader(q).tensors:
            if tensor.tensor_type.name != 'F32':
                print(p, t, tensor.name, tensor.tensor_type.name)
