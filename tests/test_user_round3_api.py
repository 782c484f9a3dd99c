"""What a new user meets (issue 48, round three), as they meet it, on the bundled tiny models: transformers'
generate arguments (use_cache, max_length, num_return_sequences, generation_config, the do_sample warning, a
BatchEncoding as input_ids, right-padded batches) against transformers' own generate; the summary line once per
model; Unsloth's names (FastModel, chat_templates, save_lora / load_lora / fast_generate with a LoRARequest,
print_trainable_parameters, push_to_hub*), GGUF export with a list of methods, the vision models' fast_generate
and GGUF message."""
from __future__ import annotations

import importlib
import json
import shutil
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import ASSETS, TINY_MODEL  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402

pytestmark = pytest.mark.torch
NEW = 6


@pytest.fixture(scope="module")
def tiny():
    """(our model, tokenizer, transformers' model) of the bundled tiny Llama."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    return model, tokenizer, AutoModelForCausalLM.from_pretrained(str(TINY_MODEL)).eval()


def _hf(hf, ids, mask=None, **kw):
    with torch.no_grad():
        return hf.generate(torch.tensor(ids).long(), attention_mask=None if mask is None else torch.tensor(mask).long(),
                           **kw).numpy()


def _batch(tokenizer, side: str) -> dict:
    tokenizer.padding_side = side
    return dict(tokenizer(["What day was Ada Jaxon born?", "Hi"], return_tensors="np", padding=True))


# ---- item 2: transformers' arguments ----
def test_use_cache_and_max_length_as_transformers(tiny):
    model, tokenizer, hf = tiny
    inputs = _batch(tokenizer, "left")
    p = inputs["input_ids"].shape[1]
    plain = model.generate(**inputs, max_new_tokens=NEW)
    np.testing.assert_array_equal(model.generate(**inputs, max_new_tokens=NEW, use_cache=True), plain)
    np.testing.assert_array_equal(plain, _hf(hf, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=NEW,
                                             do_sample=False))
    ours = model.generate(**inputs, max_length=p + 4)  # max_length counts the (padded) prompt
    theirs = _hf(hf, inputs["input_ids"], inputs["attention_mask"], max_length=p + 4, do_sample=False)
    assert ours.shape == theirs.shape == (2, p + 4)
    np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match="max_length=3 counts the prompt"):
        model.generate(**inputs, max_length=3)


def test_num_return_sequences_rows_as_transformers(tiny):
    """top_k=1 sampling is deterministic, so transformers' rows (p0, p0, p0, p1, p1, p1) can be compared exactly;
    with real sampling the n completions of a prompt are different draws."""
    model, tokenizer, hf = tiny
    inputs = _batch(tokenizer, "left")
    ours = model.generate(**inputs, max_new_tokens=NEW, num_return_sequences=3, do_sample=True, top_k=1)
    theirs = _hf(hf, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=NEW, num_return_sequences=3,
                 do_sample=True, top_k=1)
    assert ours.shape == theirs.shape == (6, inputs["input_ids"].shape[1] + NEW)
    np.testing.assert_array_equal(ours, theirs)
    drawn = model.generate(**inputs, max_new_tokens=NEW, num_return_sequences=3, do_sample=True, temperature=3.0,
                           top_k=0, eos_token_id=[], seed=1)
    np.testing.assert_array_equal(drawn[:3, :inputs["input_ids"].shape[1]], np.repeat(inputs["input_ids"][:1], 3, 0))
    assert len({tuple(r) for r in drawn[:3]}) > 1
    with pytest.raises(ValueError, match="num_return_sequences=2 needs do_sample=True"):
        model.generate(**inputs, max_new_tokens=2, num_return_sequences=2)


def test_other_transformers_arguments_are_refused_by_name(tiny):
    model, tokenizer, _ = tiny
    ids = np.array([[5, 6, 7]])
    with pytest.raises(TypeError, match="num_beams=4 is not supported: beam search"):
        model.generate(ids, max_new_tokens=2, num_beams=4)
    with pytest.raises(TypeError, match=r"stop_strings=.*fast_generate"):
        model.generate(ids, max_new_tokens=2, stop_strings=["."])
    with pytest.raises(TypeError, match="'max_new_token'"):
        model.generate(ids, max_new_token=2)
    with pytest.raises(TypeError, match="do_sample must be True or False"):
        model.generate(ids, max_new_tokens=2, do_sample="yes")
    assert model.generate(ids, max_new_tokens=2, num_beams=1, return_dict_in_generate=False).shape == (1, 5)


# ---- item 3: the do_sample warning, generation_config ----
def test_sampling_flags_without_do_sample_warn_once_and_decode_greedily(tiny):
    model, tokenizer, hf = tiny
    ids = tokenizer(["Hello there"], return_tensors="np")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=NEW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, max_new_tokens=NEW, temperature=1.5, min_p=0.1)
    np.testing.assert_array_equal(out, greedy)
    mine = [w for w in caught if issubclass(w.category, UserWarning) and "do_sample" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "temperature=1.5" in str(mine[0].message) and "min_p=0.1" in str(mine[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(ids, max_new_tokens=2, do_sample=True, temperature=1.5, min_p=0.1)
        model.generate(ids, max_new_tokens=2)
    assert not [w for w in caught if "do_sample" in str(w.message)]


def test_generation_config_do_sample_is_honoured_as_transformers(tiny, tmp_path):
    """A model whose generation_config.json says do_sample=True: transformers samples when the call does not pass
    do_sample (two torch seeds, two answers); so do we, with that file's temperature, equal to passing them."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    _, tokenizer, _ = tiny
    path = tmp_path / "sampling-model"
    shutil.copytree(TINY_MODEL, path)
    cfg = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": True, "temperature": 5.0}))
    ids = tokenizer(["Hello there"], return_tensors="np")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    hf_runs = []
    for s in (0, 1):
        torch.manual_seed(s)
        hf_runs.append(_hf(hf, ids, max_new_tokens=12, eos_token_id=None))
    assert not np.array_equal(*hf_runs)  # transformers samples
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", progress=False, load_tokenizer=False)
    a, b = (model.generate(ids, max_new_tokens=12, eos_token_id=[], seed=s) for s in (0, 1))
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, model.generate(ids, max_new_tokens=12, eos_token_id=[], seed=0, do_sample=True,
                                                    temperature=5.0, top_k=50))
    greedy = model.generate(ids, max_new_tokens=12, eos_token_id=[], do_sample=False)  # the call wins
    plain, _ = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False, load_tokenizer=False)
    np.testing.assert_array_equal(greedy, plain.generate(ids, max_new_tokens=12, eos_token_id=[]))
    # a GenerationConfig argument: the same settings as the file's
    given = plain.generate(ids, max_new_tokens=12, eos_token_id=[], seed=0,
                           generation_config=GenerationConfig(do_sample=True, temperature=5.0))
    np.testing.assert_array_equal(given, a)


# ---- item 4: a BatchEncoding as input_ids ----
def test_chat_template_batch_encoding_as_input_ids(tiny):
    model, tokenizer, hf = tiny
    enc = tokenizer.apply_chat_template([{"role": "user", "content": "What day was Ada Jaxon born?"}],
                                        add_generation_prompt=True, return_tensors="np")
    assert hasattr(enc, "keys") and "input_ids" in enc  # transformers 5: a BatchEncoding
    ours = model.generate(input_ids=enc, max_new_tokens=NEW, use_cache=True)
    np.testing.assert_array_equal(ours, model.generate(**enc, max_new_tokens=NEW))
    np.testing.assert_array_equal(ours, _hf(hf, enc["input_ids"], enc["attention_mask"], max_new_tokens=NEW,
                                            do_sample=False))
    with pytest.raises(TypeError, match="without 'input_ids'"):
        model.generate(input_ids={"ids": [[1, 2]]}, max_new_tokens=2)


# ---- item 13: right padding, the summary line ----
def test_right_padded_batch_equals_left_padded(tiny):
    model, tokenizer, hf = tiny
    left, right = _batch(tokenizer, "left"), _batch(tokenizer, "right")
    assert right["attention_mask"][1, -1] == 0 and left["attention_mask"][1, 0] == 0
    ours_left = model.generate(**left, max_new_tokens=NEW)
    ours_right = model.generate(**right, max_new_tokens=NEW)
    np.testing.assert_array_equal(ours_right, ours_left)  # returned left padded, as transformers' output
    np.testing.assert_array_equal(ours_left, _hf(hf, left["input_ids"], left["attention_mask"], max_new_tokens=NEW,
                                                 do_sample=False))
    with pytest.raises(ValueError, match="padding between real tokens"):
        model.generate(np.array([[5, 6, 7]]), np.array([[1, 0, 1]]), max_new_tokens=2)


def test_summary_line_once_per_model(capsys):
    model, _ = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False, load_tokenizer=False)
    ids = np.array([[5, 6, 7]])
    model.generate(ids, max_new_tokens=2)
    model.generate(np.array([[5, 6, 7], [8, 9, 10]]), max_new_tokens=3, do_sample=True)
    model.generate(ids, max_new_tokens=2)
    assert capsys.readouterr().err.count("KV pool") == 1


# ---- the vision models' generate ----
@pytest.fixture(scope="module")
def gemma3_vl():
    from unsloth_jax import FastVisionModel

    return FastVisionModel.from_pretrained(ASSETS / "tiny-gemma3-vl", dtype="float32", progress=False)


def _vision_batch(processor, side: str) -> dict:
    from tests import vl_models

    records = vl_models.shapes_dataset(2)
    texts = [processor.apply_chat_template([r["messages"][0]], add_generation_prompt=True) + " x" * (3 * i)
             for i, r in enumerate(records)]
    processor.tokenizer.padding_side = side
    return dict(processor(text=texts, images=[r["images"] for r in records], return_tensors="np", padding=True))


def test_vision_generate_takes_transformers_arguments(gemma3_vl):
    model, processor = gemma3_vl
    left, right = _vision_batch(processor, "left"), _vision_batch(processor, "right")
    p = left["input_ids"].shape[1]
    greedy = model.generate(**left, max_new_tokens=4)
    np.testing.assert_array_equal(model.generate(**right, max_new_tokens=4, use_cache=True), greedy)
    np.testing.assert_array_equal(model.generate(input_ids=left, max_length=p + 4), greedy)
    repeated = model.generate(**left, max_new_tokens=4, num_return_sequences=2, do_sample=True, top_k=1)
    np.testing.assert_array_equal(repeated, np.repeat(greedy, 2, axis=0))
    with pytest.raises(TypeError, match="num_beams=2 is not supported"):
        model.generate(**left, max_new_tokens=2, num_beams=2)


# ---- item 5: Unsloth's names ----
def test_fast_model_loads_text_or_vision_by_the_config():
    from unsloth_jax import FastModel, Model, VisionModel

    model, tokenizer = FastModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    assert isinstance(model, Model) and tokenizer is not None
    model = FastModel.get_peft_model(model, r=4, finetune_vision_layers=True, finetune_mlp_modules=False)
    assert model.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    vision, processor = FastModel.from_pretrained(ASSETS / "tiny-gemma3-vl", dtype="float32", progress=False)
    assert isinstance(vision, VisionModel) and processor is not None


def test_chat_templates_module_has_unsloths_names(tiny):
    from unsloth_jax.chat_templates import (get_chat_template, standardize_data_formats, standardize_sharegpt,
                                            train_on_responses_only)
    from unsloth_jax.data import response_only

    _, tokenizer, _ = tiny
    tok = get_chat_template(tokenizer.__class__.from_pretrained(str(TINY_MODEL)), chat_template="llama-3")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|start_header_id|>user<|end_header_id|>" in text
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    want = [{"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    assert standardize_sharegpt(rows) == standardize_data_formats(rows) == want
    assert train_on_responses_only is response_only.train_on_responses_only


def test_print_trainable_parameters_as_peft(capsys):
    """The same LoRA on transformers' model through PEFT prints the same line."""
    import peft
    from transformers import AutoModelForCausalLM

    model, _ = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False, load_tokenizer=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8)
    capsys.readouterr()
    model.print_trainable_parameters()
    ours = capsys.readouterr().out.strip()
    hf = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(TINY_MODEL)), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"]))
    hf.print_trainable_parameters()
    assert ours == capsys.readouterr().out.strip()
    assert ours.startswith("trainable params: ")
    assert model.get_nb_trainable_parameters() == hf.get_nb_trainable_parameters()


def test_save_lora_load_lora_and_fast_generate_with_the_request(tmp_path):
    """An adapter saved, the model's LoRA then changed: fast_generate with load_lora's request equals generation
    with the saved adapter loaded, and the model's own LoRA is untouched."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from unsloth_jax import SamplingParams

    model, tokenizer = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8)

    def randomise(seed):
        for i, lin in enumerate(model.projections().values()):
            lin.lora_b[...] = 0.5 * jax.random.normal(jax.random.PRNGKey(seed * 100 + i), lin.lora_b[...].shape)

    randomise(1)
    model.save_lora(tmp_path / "grpo_saved_lora")
    randomise(2)
    changed = jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["What day was Ada Jaxon born?", "Hello"]
    request = model.load_lora(tmp_path / "grpo_saved_lora")
    assert request.lora_path == str(tmp_path / "grpo_saved_lora") and request.lora_int_id >= 1
    with_request = model.fast_generate(prompts, params, lora_request=request)
    saved, _ = FastLanguageModel.from_pretrained(tmp_path / "grpo_saved_lora", dtype="float32", progress=False)
    reference = saved.fast_generate(prompts, params, tokenizer=tokenizer)
    own = model.fast_generate(prompts, params)
    assert [o.outputs[0].token_ids for o in with_request] == [o.outputs[0].token_ids for o in reference]
    assert [o.outputs[0].token_ids for o in own] != [o.outputs[0].token_ids for o in reference]
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam)), changed)
    assert jnp.dtype(model.dtype) == jnp.float32
    with pytest.raises(TypeError, match="load_lora"):
        model.fast_generate(prompts, params, lora_request="grpo_saved_lora")


# ---- item 6: push_to_hub ----
class _FakeApi:
    """huggingface_hub.HfApi stand-in: records the token, the repository and the uploaded folder's files."""

    calls: list = []

    def __init__(self, token=None, **kwargs):
        self.token = token

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, self.token, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        from pathlib import Path

        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload_folder", repo_id, self.token, files))


@pytest.fixture
def lora_model():
    model, tokenizer = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    return FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8), tokenizer


def test_push_to_hub_uploads_what_save_pretrained_writes(lora_model, monkeypatch, tmp_path):
    import huggingface_hub

    model, tokenizer = lora_model
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeApi)
    _FakeApi.calls = []
    url = model.push_to_hub("me/adapter", tokenizer=tokenizer, token="hf_secret")
    model.save_pretrained(tmp_path / "local", tokenizer=tokenizer)
    assert url == "https://huggingface.co/me/adapter"
    (_, repo, token, kw), (_, repo2, token2, files) = _FakeApi.calls
    assert (repo, token, repo2, token2) == ("me/adapter", "hf_secret", "me/adapter", "hf_secret")
    assert kw["exist_ok"] is True
    assert files == sorted(p.name for p in (tmp_path / "local").iterdir())
    assert "adapter_model.safetensors" in files and "tokenizer.json" in files
    _FakeApi.calls = []
    model.push_to_hub_merged("me/merged", tokenizer, token="t")
    assert "model.safetensors" in _FakeApi.calls[1][3] and "config.json" in _FakeApi.calls[1][3]
    _FakeApi.calls = []
    model.push_to_hub_gguf("me/gguf", tokenizer, quantization_method=["q8_0", "f16"], token="t")
    assert _FakeApi.calls[1][3] == ["unsloth.F16.gguf", "unsloth.Q8_0.gguf"]


@pytest.mark.parametrize("offline", ["offline_mode", "connect_error"])
def test_push_to_hub_without_network_says_what_to_do(lora_model, monkeypatch, offline):
    """huggingface_hub's own errors with no network: HF_HUB_OFFLINE's OfflineModeIsEnabled, and its HTTP client's
    connection error."""
    import huggingface_hub
    from huggingface_hub import errors

    model, _ = lora_model
    if offline == "offline_mode":
        error = errors.OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled.")
    else:
        http = importlib.import_module(errors.HTTPError.__module__)  # huggingface_hub's HTTP client (httpx2)
        error = http.ConnectError("[Errno -3] Temporary failure in name resolution")

    def fail(self, repo_id, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fail)
    with pytest.raises(ConnectionError, match=r"'me/adapter'.*save_pretrained\(dir\) and upload") as info:
        model.push_to_hub("me/adapter")
    assert info.value.__cause__ is error


# ---- items 7, 8: GGUF with a list of methods; the vision models' fast_generate and GGUF ----
def test_save_pretrained_gguf_takes_a_list(lora_model, tmp_path):
    import gguf

    model, tokenizer = lora_model
    paths = model.save_pretrained_gguf(tmp_path, tokenizer, quantization_method=["q8_0", "f16"])
    assert [p.rsplit("/", 1)[1] for p in paths] == ["unsloth.Q8_0.gguf", "unsloth.F16.gguf"]
    kinds = [{t.tensor_type.name for t in gguf.GGUFReader(p).tensors} for p in paths]
    assert "Q8_0" in kinds[0] and "Q8_0" not in kinds[1] and "F16" in kinds[1]
    assert isinstance(model.save_pretrained_gguf(tmp_path / "one", tokenizer, quantization_method="f16"), str)
    with pytest.raises(TypeError, match="quantization_method"):
        model.save_pretrained_gguf(tmp_path, tokenizer, quantization_method=[])


def test_vision_model_fast_generate_and_gguf_say_what_to_use(gemma3_vl, tmp_path):
    from unsloth_jax.inference import SamplingParams

    model, processor = gemma3_vl
    # fast_generate serves vision-language models now (tests/test_grpo_vision.py): text through the processor
    out = model.fast_generate(["What colour is the square?"], SamplingParams(max_tokens=2, ignore_eos=True),
                              processor=processor)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(NotImplementedError, match=r"save_pretrained_merged.*--mmproj"):
        model.save_pretrained_gguf(tmp_path, processor, quantization_method="q8_0")
    with pytest.raises(NotImplementedError, match="--mmproj"):
        model.push_to_hub_gguf("me/vl", processor)


def test_saves_return_the_paths_they_wrote(lora_model, tmp_path):
    """save_pretrained / save_pretrained_merged / save_lora of Model (adapter and full fine-tuning), VisionModel
    and QwenVisionModel return the folder they wrote (save_pretrained_gguf: the file, above)."""
    from tests import vl_qwen_models
    from unsloth_jax import FastVisionModel

    model, tokenizer = lora_model
    saves = {"adapter": lambda d: model.save_pretrained(d, tokenizer=tokenizer),
             "merged": lambda d: model.save_pretrained_merged(d, tokenizer),
             "merged_lora": lambda d: model.save_pretrained_merged(d, tokenizer, save_method="lora"),
             "lora": model.save_lora}
    full, _ = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", full_finetuning=True, progress=False)
    saves["full"] = full.save_pretrained
    vl, processor = FastVisionModel.from_pretrained(ASSETS / "tiny-gemma3-vl", dtype="float32", progress=False)
    vl = FastVisionModel.get_peft_model(vl, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    saves["vision_adapter"] = lambda d: vl.save_pretrained(d, processor)
    saves["vision_merged"] = lambda d: vl.save_pretrained_merged(d, processor)
    vl_qwen_models.hf_qwen_vl().save_pretrained(tmp_path / "qwen_base")
    qwen, _ = FastVisionModel.from_pretrained(tmp_path / "qwen_base", dtype="float32", progress=False)
    qwen = FastVisionModel.get_peft_model(qwen, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    saves["qwen_adapter"] = qwen.save_pretrained
    saves["qwen_merged"] = qwen.save_pretrained_merged
    for name, save in saves.items():
        folder = tmp_path / name
        assert save(folder) == str(folder), name
        written = {p.name for p in folder.iterdir()}
        assert "adapter_config.json" in written or "config.json" in written, (name, written)
