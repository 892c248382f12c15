"""Write a small GGUF file from a local HF Llama folder (the tiny target), the way llama.cpp's
converter lays one out, so the import path is tested on a real GGUF without a download.

Facts this relies on (GGUF's llama layout): tensors are named ``token_embd``, ``blk.N.attn_q`` ...,
``output``; the q/k projections are stored with their rotary halves interleaved per head (transformers
undoes that on load); the tokenizer is stored as its token list, token types (1 normal, 3 control,
4 user-defined), BPE merges and special ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def interleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Per head, reorder the rows from [first half | second half] to pairs (llama.cpp's layout)."""
    rows = w.shape[0] // heads
    return w.reshape(heads, 2, rows // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(folder: Path, config: dict) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    state = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if "lm_head.weight" in state:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        for hf, gg in LAYER_NAMES.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = interleave_rotary(w, config["num_attention_heads"])
            elif gg == "attn_k":
                w = interleave_rotary(w, config["num_key_value_heads"])
            out[f"blk.{i}.{gg}.weight"] = w
    return out


def _tokenizer(writer, folder: Path, vocab_size: int) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    added = {a["content"]: a for a in tok["added_tokens"]}
    by_id = {i: t for t, i in tok["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tok["added_tokens"]}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [(3 if added[t]["special"] else 4) if t in added else (5 if t.startswith("[PAD") else 1) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    template = (
        (folder / "chat_template.jinja").read_text()
        if (folder / "chat_template.jinja").exists()
        else tcfg.get("chat_template")
    )
    writer.add_chat_template(template)


def write_gguf(folder: str | Path, out: str | Path, architecture: str = "llama") -> Path:
    """``folder``: a Llama-architecture HF folder with one model.safetensors. ``architecture`` other
    than llama writes that name into the header (for testing refusals) over the same tensors."""
    import gguf

    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name("tiny test target")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(writer, folder, config["vocab_size"])
    for name, tensor in _tensors(folder, config).items():
        writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
