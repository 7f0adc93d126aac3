"""Runs in kvpress's own venv (kvpress 0.5.5, transformers < 5.3): each press at each compression ratio on one
model and one text, and writes what it kept and the next token's logits (safetensors, no pickles).

    python kvpress_side.py MODEL_FOLDER IDS.json OUT.safetensors
IDS.json: {"ids": [...]} (the prompt; its last token is fed after the compressed prefill)."""
import json
import sys

import torch
from kvpress import (ExpectedAttentionPress, KeyDiffPress, KnormPress, ObservedAttentionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress,
                     TOVAPress)
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DynamicCache

PRESSES = {"streaming_llm": StreamingLLMPress, "knorm": KnormPress, "snapkv": SnapKVPress, "tova": TOVAPress,
           "observed_attention": ObservedAttentionPress, "keydiff": KeyDiffPress, "pyramidkv": PyramidKVPress,
           "expected_attention": ExpectedAttentionPress}
RATIOS = (0.5, 0.8)


def main(folder, ids_file, out):
    ids = torch.tensor([json.load(open(ids_file))["ids"]])
    prompt, last = ids[:, :-1], ids[:, -1:]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    tensors = {}
    for name, cls in PRESSES.items():
        for ratio in RATIOS:
            press, kept = cls(compression_ratio=ratio), {}
            compress = press.compress

            def recording(module, hidden_states, keys, values, attentions, kwargs, compress=compress, kept=kept):
                k, v = compress(module, hidden_states, keys, values, attentions, kwargs)
                # the kept positions: each surviving key row found among the layer's keys (B = 1)
                match = (k[0][:, :, None, :] == keys[0][:, None, :, :]).all(-1)  # (H, n_kept, T)
                kept[module.layer_idx] = match.float().argmax(-1).sort(-1).values
                return k, v
            press.compress = recording
            cache = DynamicCache()
            with torch.no_grad(), press(model):
                model(prompt, past_key_values=cache)
            tag = f"{name}/{ratio}"
            try:
                with torch.no_grad():
                    logits = model(last, past_key_values=cache, position_ids=torch.tensor([[prompt.shape[1]]])).logits
                tensors[f"{tag}/logits"] = logits[0, -1].contiguous()
            except RuntimeError as e:  # PyramidKV's layers of different lengths: the next call's mask does not fit
                print(tag, "no next-token logits:", str(e).splitlines()[0], file=sys.stderr)
            for layer, positions in kept.items():
                tensors[f"{tag}/kept/{layer}"] = positions.contiguous()
            print(tag, "kept", positions.shape[-1], "of", prompt.shape[1], file=sys.stderr)
    with torch.no_grad():
        tensors["full/logits"] = model(ids).logits[0, -1].contiguous()
    save_file(tensors, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
