#!/usr/bin/env python3
"""Write a tiny llama-architecture GGUF model with random weights.

Used by tests/real_server.py to give a real llama.cpp server (llama-cpp-python's
`python -m llama_cpp.server`) something to load without downloading a model.
Runs under the interpreter of a virtual environment that has the `gguf` and
`numpy` packages from PyPI:

    VENV/bin/python tests/make_tiny_gguf.py /tmp/x/tiny.gguf

The model is nonsense (random F32 weights, 2 layers, embedding 64) but valid:
llama.cpp loads it and generates tokens. The vocabulary is SentencePiece-style
(tokenizer.ggml.model "llama"): <unk>, <s>, </s>, the 256 byte tokens
<0x00>..<0xFF> (so any prompt tokenises through byte fallback) and a few
ordinary pieces. About 0.2 MB, written in well under a second.
"""

import argparse
import sys

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 128
N_CTX = 256
PIECES = [u"\u2581", u"\u2581t", u"\u2581test", u"te", u"st", u"es", u"t", u"e", u"s",
          u"a", u"o", u"i", u"n"]

# gguf.TokenType values, spelled out so that the file reads without the package
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6


def vocabulary():
    """(tokens, scores, types) of a minimal SPM vocabulary."""
    tokens = [u"<unk>", u"<s>", u"</s>"]
    scores = [0.0, 0.0, 0.0]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL]
    for b in range(256):
        tokens.append(u"<0x%02X>" % b)
        scores.append(0.0)
        types.append(TOKEN_BYTE)
    for i, piece in enumerate(PIECES):
        tokens.append(piece)
        scores.append(-float(i + 1))   # SPM merges prefer higher scores
        types.append(TOKEN_NORMAL)
    return tokens, scores, types


def make(path, seed=0, name="tiny-random-llama"):
    """Write the model to path; return the number of tokens in its vocabulary."""
    import numpy as np
    import gguf

    rng = np.random.RandomState(seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    head_dim = N_EMBD // N_HEAD
    n_embd_kv = head_dim * N_HEAD_KV

    def rand(*shape):
        # numpy shape is ggml's ne reversed: (rows = outputs, cols = inputs)
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n):
        return np.ones((n,), dtype=np.float32)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_file_type(0)                      # LLAMA_FTYPE_ALL_F32
    w.add_vocab_size(n_vocab)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)

    w.add_tensor("token_embd.weight", rand(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        p = "blk.%d." % i
        w.add_tensor(p + "attn_norm.weight", ones(N_EMBD))
        w.add_tensor(p + "attn_q.weight", rand(N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_k.weight", rand(n_embd_kv, N_EMBD))
        w.add_tensor(p + "attn_v.weight", rand(n_embd_kv, N_EMBD))
        w.add_tensor(p + "attn_output.weight", rand(N_EMBD, N_EMBD))
        w.add_tensor(p + "ffn_norm.weight", ones(N_EMBD))
        w.add_tensor(p + "ffn_gate.weight", rand(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_up.weight", rand(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_down.weight", rand(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", ones(N_EMBD))
    w.add_tensor("output.weight", rand(n_vocab, N_EMBD))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n_vocab


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="GGUF file to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n_vocab = make(args.path, seed=args.seed)
    print("wrote %s (llama, %d layers, n_embd %d, n_vocab %d, F32 random)"
          % (args.path, N_LAYER, N_EMBD, n_vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
