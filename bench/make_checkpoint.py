"""Write a random-init transformers checkpoint of an ANCHORS.md shape (bf16 safetensors), on the GPU if present.

    python bench/make_checkpoint.py qwen2-1.5b /tmp/ckpt/qwen2-1.5b
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402

from bench.shapes import SHAPES  # noqa: E402


def main(name: str, out: str) -> None:
    if os.path.isfile(os.path.join(out, "config.json")):
        return
    kw = dict(SHAPES[name])
    model_type = kw.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    t0 = time.time()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    print(f"wrote {name} to {out} in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
