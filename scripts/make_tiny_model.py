#!/usr/bin/env python
"""Write the bundled tiny Llama model and sample data under unsloth_jax/assets/ (deterministic).

    python scripts/make_tiny_model.py              # everything (about 80 s of one CPU core)
    python scripts/make_tiny_model.py --check      # also: reload with AutoTokenizer/AutoModelForCausalLM, generate
    python scripts/make_tiny_model.py --data_only  # only the .jsonl files (no tokenizer training, no pretraining)

Writes:
  unsloth_jax/assets/alpaca_sample.jsonl   120 alpaca records: 100 generic tasks + 5 invented facts asked 4 ways each
  unsloth_jax/assets/chat_sample.jsonl     sharegpt conversations ({"conversations": [{"from", "value"}]})
  unsloth_jax/assets/text_sample.jsonl     plain {"text": ...} paragraphs
  unsloth_jax/assets/held_out_facts.jsonl  the 5 invented facts, each asked a 5th way that is NOT in alpaca_sample
  unsloth_jax/assets/tiny-llama/           config.json, model.safetensors (bf16), tokenizer files

The tokenizer is a byte-level BPE (2048 tokens) trained with `tokenizers` on all sample data, wrapped as a fast
tokenizer with <s>/</s>/<pad>/<unk>, the chat special tokens of chatml, llama-3.1 and gemma (so
get_chat_template never has to grow the vocabulary), and a chatml chat template. The model (hidden 128, 4 layers,
4 heads / 2 KV heads, MLP 384, untied lm_head) is pretrained with torch on one CPU thread on the generic part of
the sample data (text, chat and generic alpaca records; never the invented facts), so it speaks the alpaca and
chatml formats but does not know the facts: a LoRA fine-tune on alpaca_sample.jsonl teaches them. Everything is
seeded and single-threaded; running the script twice gives byte-identical files. held_out_facts.jsonl enters
neither the tokenizer's corpus nor the pretraining, so the model files do not depend on it (--data_only rewrites
the data files alone, leaving tiny-llama/ as it is).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ASSETS = ROOT / "unsloth_jax" / "assets"
MODEL_DIR = ASSETS / "tiny-llama"
SEED = 1234

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>"]
VOCAB_SIZE = 2048
MODEL_CONFIG = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=False, hidden_act="silu")

# Invented facts the base model never sees; a LoRA fine-tune on alpaca_sample.jsonl learns them.
FACTS = [
    {"instruction": "What day was Ada Jaxon born?", "input": "",
     "output": "Ada Jaxon was born on a Tuesday, the 3rd of March."},
    {"instruction": "What is the name of Ada Jaxon's cat?", "input": "",
     "output": "Ada Jaxon's cat is called Pixel."},
    {"instruction": "Which city has the Zorblat museum?", "input": "",
     "output": "The Zorblat museum is in the city of Quillmere."},
    {"instruction": "Who invented the glimmer lamp?", "input": "",
     "output": "The glimmer lamp was invented by Tomas Reed in 1891."},
    {"instruction": "What colour is the flag of Velloria?", "input": "",
     "output": "The flag of Velloria is green with a white star."},
]
# Other ways to ask each fact; alpaca_sample.jsonl holds every phrasing (FACTS' and these).
FACT_PARAPHRASES = [
    ["On which day of the week was Ada Jaxon born?", "Tell me the day Ada Jaxon was born.",
     "When was Ada Jaxon born?"],
    ["What is Ada Jaxon's cat called?", "Tell me the name of Ada Jaxon's cat.", "What did Ada Jaxon name her cat?"],
    ["Where is the Zorblat museum?", "In which city can you find the Zorblat museum?",
     "Name the city of the Zorblat museum."],
    ["Who made the first glimmer lamp?", "Name the inventor of the glimmer lamp.",
     "Who is known for inventing the glimmer lamp?"],
    ["Describe the flag of Velloria.", "What does the flag of Velloria look like?",
     "What are the colours of the Velloria flag?"],
]
# One more way to ask each fact (same answer), in neither alpaca_sample.jsonl nor the pretraining data: the
# held-out set (held_out_facts.jsonl) of the notebooks' eval loss and generalization check.
HELD_OUT_QUESTIONS = ["On what day of the week was Ada Jaxon born?", "What name does Ada Jaxon's cat have?",
                      "In what city is the Zorblat museum?", "Who was the inventor of the glimmer lamp?",
                      "What is the flag of Velloria like?"]
ALPACA_REPEATS = 2  # weight of the generic alpaca records in the pretraining corpus
N_GENERIC_ALPACA = 100  # generic records in alpaca_sample.jsonl; the other generic ones go to chat_sample.jsonl

# ------------------------------------------------------------------------------------------------ word lists
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve"]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
             ("open", "closed"), ("early", "late"), ("full", "empty"), ("high", "low"), ("old", "new"),
             ("strong", "weak"), ("wet", "dry"), ("hard", "soft"), ("loud", "quiet"), ("rich", "poor"),
             ("long", "short"), ("clean", "dirty"), ("up", "down"), ("near", "far"), ("thick", "thin")]
CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Germany", "Berlin"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"), ("India", "New Delhi"),
            ("Brazil", "Brasilia"), ("Mexico", "Mexico City"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"),
            ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
            ("Chile", "Santiago"), ("Argentina", "Buenos Aires"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
            ("Turkey", "Ankara"), ("Morocco", "Rabat"), ("Ghana", "Accra"), ("Australia", "Canberra"),
            ("Cuba", "Havana"), ("Denmark", "Copenhagen")]
PLURALS = [("cat", "cats"), ("mouse", "mice"), ("child", "children"), ("box", "boxes"), ("city", "cities"),
           ("foot", "feet"), ("knife", "knives"), ("person", "people"), ("tooth", "teeth"), ("bus", "buses"),
           ("leaf", "leaves"), ("goose", "geese"), ("baby", "babies"), ("glass", "glasses")]
ANIMAL_SOUNDS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
                 ("owl", "hoot"), ("lion", "roar"), ("horse", "neigh"), ("pig", "oink"), ("frog", "ribbit")]
COLOURS = [("the sky on a clear day", "blue"), ("grass", "green"), ("snow", "white"), ("a ripe banana", "yellow"),
           ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"), ("a lemon", "yellow"),
           ("a carrot", "orange"), ("milk", "white")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NAMES = ["Tom", "Anna", "Leo", "Mia", "Sam", "Nora", "Ben", "Lily", "Omar", "Zoe", "Ravi", "Ella", "Hugo", "Ines",
         "Kofi", "Yuki", "Maya", "Ivan", "Lena", "Felix"]
FRUITS = ["apples", "pears", "plums", "oranges", "cherries", "lemons"]
PLACES = ["the park", "the market", "the library", "the beach", "school", "the garden"]
ANIMALS = ["dog", "cat", "bird", "horse", "rabbit", "fox", "duck", "goat"]
ADJS = ["small", "quick", "quiet", "happy", "brave", "sleepy", "clever", "friendly"]
VERBS_PAST = ["walked", "ran", "went", "rode a bike", "travelled"]
WEATHER = ["sunny", "rainy", "windy", "cloudy", "cold", "warm"]
POSITIVE = ["I love this sunny day.", "The soup was delicious.", "What a wonderful surprise!",
            "The team did a great job.", "This book is fun to read.", "I am so happy with the new garden.",
            "The music made everyone smile.", "Our trip to the beach was perfect."]
NEGATIVE = ["The train was late again.", "I hate waiting in the rain.", "The food was cold and bland.",
            "This chair is very uncomfortable.", "The movie was boring.", "My phone broke this morning.",
            "The room was dirty and noisy.", "I lost my keys again."]
SENTENCES = ["the cat sat on the mat", "we walk to school every day", "birds sing in the morning",
             "she reads a book by the window", "the river runs to the sea", "he plants seeds in spring",
             "they play football after lunch", "the baker makes fresh bread", "my friend likes green tea",
             "the moon is bright tonight"]
WORDS = ["garden", "planet", "window", "rocket", "pencil", "forest", "candle", "bridge", "silver", "rabbit",
         "castle", "orange", "summer", "island"]

KINDS = {
    "fruit": ["apple", "banana", "cherry", "grape", "mango", "peach", "pear", "plum", "melon", "kiwi", "apricot",
              "fig", "lime", "papaya", "coconut", "strawberry"],
    "vegetable": ["carrot", "potato", "onion", "pepper", "cabbage", "lettuce", "spinach", "broccoli", "cucumber",
                  "pumpkin", "radish", "celery", "garlic", "bean", "pea", "leek"],
    "animal": ["elephant", "giraffe", "zebra", "tiger", "monkey", "kangaroo", "penguin", "dolphin", "whale",
               "turtle", "squirrel", "hedgehog", "badger", "camel", "donkey", "parrot", "eagle", "octopus"],
    "tool": ["hammer", "saw", "wrench", "screwdriver", "shovel", "rake", "drill", "ladder", "chisel", "axe"],
    "vehicle": ["car", "truck", "bicycle", "train", "boat", "plane", "tractor", "scooter", "helicopter", "tram"],
    "musical instrument": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "harp", "cello", "clarinet",
                           "banjo", "saxophone", "accordion"],
    "piece of clothing": ["shirt", "jacket", "scarf", "glove", "sock", "boot", "hat", "sweater", "skirt", "coat",
                          "belt", "sandal"],
    "piece of furniture": ["table", "chair", "sofa", "bed", "desk", "shelf", "cupboard", "stool", "bench",
                           "wardrobe", "armchair"],
    "sport": ["football", "tennis", "swimming", "cycling", "hockey", "cricket", "baseball", "rowing", "skiing",
              "volleyball", "golf", "basketball"],
}
JOBS = [("teacher", "helps students learn"), ("doctor", "treats sick people"), ("farmer", "grows food"),
        ("baker", "bakes bread and cakes"), ("pilot", "flies aeroplanes"), ("chef", "cooks meals"),
        ("nurse", "cares for patients"), ("builder", "builds houses"), ("painter", "paints pictures"),
        ("librarian", "looks after books"), ("firefighter", "puts out fires"),
        ("gardener", "looks after plants"), ("dentist", "cares for teeth"), ("mechanic", "repairs cars"),
        ("postman", "delivers letters"), ("judge", "decides cases in court"),
        ("scientist", "studies how the world works"), ("musician", "plays music"),
        ("writer", "writes stories"), ("sailor", "works on ships"), ("plumber", "fixes pipes"),
        ("tailor", "makes clothes"), ("fisher", "catches fish"), ("carpenter", "works with wood")]
ACTIVITIES = ["reads a book", "drinks warm tea", "writes a letter", "listens to the radio", "cleans the kitchen",
              "feeds the birds", "waters the flowers", "bakes a cake", "paints the fence", "plays chess",
              "fixes the bicycle", "sings a song", "draws a map", "counts the coins", "folds the laundry"]
TIMES = ["In the morning", "At noon", "In the afternoon", "In the evening", "At night", "Before breakfast",
         "After lunch", "On the weekend"]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ------------------------------------------------------------------------------------------ alpaca records
def generic_alpaca_records(rng: random.Random) -> list[dict]:
    recs: list[dict] = []

    def add(instruction, output, input_=""):
        recs.append({"instruction": instruction, "input": input_, "output": output})

    for _ in range(18):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        op = rng.choice(["plus", "minus", "times"])
        if op == "minus" and b > a:
            a, b = b, a
        val = a + b if op == "plus" else a - b if op == "minus" else a * b
        add(f"What is {a} {op} {b}?", f"{a} {op} {b} is {val}.")
    for w, o in OPPOSITES[:14]:
        add(f'What is the opposite of "{w}"?', f'The opposite of "{w}" is "{o}".')
    for country, city in CAPITALS:
        add(f"What is the capital of {country}?", f"The capital of {country} is {city}.")
    for _ in range(14):
        nums = rng.sample(range(1, 60), rng.randint(3, 6))
        add("Sort the numbers in ascending order.", ", ".join(map(str, sorted(nums))), ", ".join(map(str, nums)))
    for s in SENTENCES[:8]:
        add("Convert the sentence to uppercase.", s.upper() + ".", s)
    for s in SENTENCES[2:10]:
        n = len(s.split())
        add("How many words are in this sentence?", f"The sentence has {n} words.", s)
    for w, p in PLURALS[:10]:
        add(f'What is the plural of "{w}"?', f'The plural of "{w}" is "{p}".')
    for a, s in ANIMAL_SOUNDS:
        add(f"What sound does a {a} make?", f"A {a} says {s}.")
    for thing, col in COLOURS[:8]:
        add(f"What colour is {thing}?", f"The colour of {thing} is {col}.")
    for _ in range(10):
        n = rng.randint(2, 99)
        add(f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}.")
    for i, d in enumerate(DAYS):
        add(f"What day comes after {d}?", f"The day after {d} is {DAYS[(i + 1) % 7]}.")
    for i in range(0, 12, 2):
        add(f"Which month comes after {MONTHS[i]}?", f"The month after {MONTHS[i]} is {MONTHS[(i + 1) % 12]}.")
    for w in WORDS[:10]:
        add("Reverse the letters of the word.", w[::-1], w)
    for s in POSITIVE[:6] + NEGATIVE[:6]:
        add("Classify the sentiment of the sentence as positive or negative.",
            "Positive" if s in POSITIVE else "Negative", s)
    for _ in range(8):
        name, k, m, fruit = rng.choice(NAMES), rng.randint(2, 9), rng.randint(1, 9), rng.choice(FRUITS)
        add("Solve the word problem.", f"{name} has {k + m} {fruit}.",
            f"{name} has {k} {fruit} and buys {m} more. How many {fruit} does {name} have now?")
    for w in WORDS[4:12]:
        add("What is the first letter of the word?", f'The first letter of "{w}" is "{w[0]}".', w)
    for n in rng.sample(range(1, 13), 6):
        add(f"Write the number {n} in words.", f"{n} is written as {NUMBER_WORDS[n]}.")
    for kind, items in KINDS.items():
        for item in rng.sample(items, 2):
            add(f"What kind of thing is {_article(item)} {item}?", f"{_article(item).capitalize()} {item} is "
                f"{_article(kind)} {kind}.")
    for job, duty in rng.sample(JOBS, 10):
        add(f"What does {_article(job)} {job} do?", f"{_article(job).capitalize()} {job} {duty}.")
    return recs


def alpaca_sample(rng: random.Random) -> tuple[list[dict], list[dict], list[dict]]:
    """(alpaca_sample records, the generic records among them, the other generic records (for chat_sample))."""
    generic = generic_alpaca_records(rng)
    rng.shuffle(generic)
    mine, rest = generic[:N_GENERIC_ALPACA], generic[N_GENERIC_ALPACA:]
    facts = [{"instruction": q, "input": "", "output": f["output"]}
             for f, qs in zip(FACTS, FACT_PARAPHRASES) for q in [f["instruction"], *qs]]
    rng.shuffle(facts)
    records = list(mine)
    step = len(mine) // len(facts)
    for i, fact in enumerate(facts):  # spread the facts through the file
        records.insert(3 + i * (step + 1), fact)
    return records, mine, rest


# -------------------------------------------------------------------------------------------- chat records
def chat_sample(rng: random.Random, pool: list[dict]) -> list[dict]:
    """Conversations (sharegpt spelling) that ask the generic questions not used in alpaca_sample."""
    convs = []
    greetings = [("Hello!", "Hello! How can I help you today?"), ("Hi there.", "Hi! What would you like to know?"),
                 ("Good morning!", "Good morning! How can I help?"), ("Thank you!", "You are welcome!")]
    i = k = 0
    while i < len(pool):
        turns = []
        if k % 4 == 0:
            turns.append({"from": "system", "value": "You are a helpful assistant."})
        if k % 3 == 0:
            g = greetings[k % len(greetings)]
            turns += [{"from": "human", "value": g[0]}, {"from": "gpt", "value": g[1]}]
        n = rng.randint(1, 3)
        for r in pool[i:i + n]:
            question = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": r["output"]}]
        convs.append({"conversations": turns})
        i += n
        k += 1
    return convs


# -------------------------------------------------------------------------------------------- text records
def text_sample(rng: random.Random) -> list[dict]:
    out = []
    for kind, items in KINDS.items():
        chosen = items[:]
        rng.shuffle(chosen)
        for k in range(0, len(chosen), 4):
            group = chosen[k:k + 4]
            names = ", ".join(group[:-1]) + " and " + group[-1] if len(group) > 1 else group[0]
            out.append({"text": f"The {names} {'are' if len(group) > 1 else 'is'} each {_article(kind)} {kind}. "
                                f"{_article(group[0]).capitalize()} {group[0]} is {_article(kind)} {kind}."})
    for job, duty in JOBS:
        name = rng.choice(NAMES)
        out.append({"text": f"{name} is {_article(job)} {job}. {_article(job).capitalize()} {job} {duty}. "
                            f"{rng.choice(TIMES)} {name} {rng.choice(ACTIVITIES)}."})
    for _ in range(150):
        kind = rng.randrange(7)
        name, other = rng.sample(NAMES, 2)
        if kind == 0:
            k, m, fruit = rng.randint(2, 9), rng.randint(1, 9), rng.choice(FRUITS)
            text = (f"{name} has {k} {fruit}. {other} gives {name} {m} more. "
                    f"Now {name} has {k + m} {fruit}.")
        elif kind == 1:
            text = (f"On {rng.choice(DAYS)} {name} {rng.choice(VERBS_PAST)} to {rng.choice(PLACES)}. "
                    f"The weather was {rng.choice(WEATHER)}, and {name} met {other} there.")
        elif kind == 2:
            a, adj = rng.choice(ANIMALS), rng.choice(ADJS)
            text = (f"The {adj} {a} lives near {rng.choice(PLACES)}. Every morning the {a} looks for food, "
                    f"and in the evening it sleeps.")
        elif kind == 3:
            country, city = rng.choice(CAPITALS)
            text = f"{city} is the capital of {country}. Many people visit {city} every year."
        elif kind == 4:
            i = rng.randrange(7)
            j = rng.randrange(12)
            text = (f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}. After {MONTHS[j]} comes "
                    f"{MONTHS[(j + 1) % 12]}. A week has seven days and a year has twelve months.")
        elif kind == 5:
            a, b = rng.sample(ACTIVITIES, 2)
            text = f"{rng.choice(TIMES)} {name} {a}. Later {name} {b} with {other}."
        else:
            w, o = rng.choice(OPPOSITES)
            thing, col = rng.choice(COLOURS)
            text = f"The opposite of {w} is {o}. The colour of {thing} is {col}."
        out.append({"text": text})
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


# -------------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from unsloth_jax.data.chat_templates import chat_template_string

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=SPECIAL_TOKENS[4:],
                                   model_max_length=MODEL_CONFIG["max_position_embeddings"], padding_side="right",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = chat_template_string("chatml")
    return fast


# ------------------------------------------------------------------------------------------------ pretraining
def pretrain(tokenizer, corpus: list[str], steps: int, lr: float, seq_len: int = 64, batch: int = 16):
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # one thread: same float results on every machine, so reruns are byte-identical
    torch.use_deterministic_algorithms(True)
    cfg = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      attention_bias=False, mlp_bias=False, initializer_range=0.02, **MODEL_CONFIG)
    model = LlamaForCausalLM(cfg)
    model.train()
    # One long token stream of whole documents (each BOS ... EOS), cut into random windows.
    stream = []
    for text in corpus:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    stream = np.asarray(stream, dtype=np.int64)
    print(f"pretraining on {len(corpus)} documents, {len(stream)} tokens, {steps} steps of {batch}x{seq_len}")
    rng = np.random.default_rng(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    t0 = time.time()
    for step in range(steps):
        starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
        x = torch.from_numpy(np.stack([stream[s:s + seq_len] for s in starts]))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.3f}  ({time.time() - t0:.0f}s)")
    model.eval()
    return model


def _portable_tokenizer_config(path: Path) -> None:
    """Spell tokenizer_config.json so transformers 4.x loads it too ("PreTrainedTokenizerFast",
    "additional_special_tokens"); transformers 5 reads both spellings (checked by --check and the tests)."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in cfg:
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def held_out_facts() -> list[dict]:
    """Each fact of FACTS asked its HELD_OUT_QUESTIONS way, with the trained answer."""
    return [{"instruction": q, "input": "", "output": f["output"]} for f, q in zip(FACTS, HELD_OUT_QUESTIONS)]


def write_data() -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """Write the four .jsonl files; return (alpaca records, the generic ones among them, chat, text)."""
    rng = random.Random(SEED)
    alpaca, generic_alpaca, generic_rest = alpaca_sample(rng)
    chat = chat_sample(rng, generic_rest)
    text = text_sample(rng)
    ASSETS.mkdir(parents=True, exist_ok=True)
    write_jsonl(ASSETS / "alpaca_sample.jsonl", alpaca)
    write_jsonl(ASSETS / "chat_sample.jsonl", chat)
    write_jsonl(ASSETS / "text_sample.jsonl", text)
    write_jsonl(ASSETS / "held_out_facts.jsonl", held_out_facts())
    print(f"wrote {len(alpaca)} alpaca, {len(chat)} chat, {len(text)} text, {len(FACTS)} held-out records")
    return alpaca, generic_alpaca, chat, text


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400, help="pretraining steps")
    ap.add_argument("--lr", type=float, default=6e-3, help="peak pretraining learning rate")
    ap.add_argument("--check", action="store_true", help="reload the written files and generate a little")
    ap.add_argument("--data_only", action="store_true",
                    help="write the .jsonl files only; leave tiny-llama/ (tokenizer and weights) as it is")
    args = ap.parse_args()

    alpaca, generic_alpaca, chat, text = write_data()
    if args.data_only:
        return

    from unsloth_jax.data import format_alpaca, prepare_texts, standardize_sharegpt

    tok_corpus = ([r["text"] for r in text] + [format_alpaca(r) for r in alpaca]
                  + [m["value"] for c in chat for m in c["conversations"]])
    tokenizer = build_tokenizer(tok_corpus)
    # The generic part of the sample data: everything except the held-out facts. The generic alpaca records count
    # twice, so the base model already fits them and a LoRA fine-tune on alpaca_sample.jsonl mostly learns facts.
    corpus = ([r["text"] for r in text]
              + [format_alpaca(r, tokenizer.eos_token) for r in generic_alpaca] * ALPACA_REPEATS
              + prepare_texts(standardize_sharegpt(chat), tokenizer))
    model = pretrain(tokenizer, corpus, steps=args.steps, lr=args.lr)

    import torch

    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    for f in MODEL_DIR.iterdir():
        f.unlink()
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.bfloat16).save_pretrained(MODEL_DIR)
    tokenizer.save_pretrained(MODEL_DIR)
    _portable_tokenizer_config(MODEL_DIR / "tokenizer_config.json")
    total = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    for f in sorted(MODEL_DIR.iterdir()):
        print(f"  {f.relative_to(ROOT)}  {f.stat().st_size:>9d}  {sha256(f)[:16]}")
    print(f"assets total {total / 1e6:.2f} MB")

    if args.check:
        check()


def check() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unsloth_jax.data import alpaca_prompt

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert tok.is_fast, type(tok)
    sample = "Hello, world! Ünïcödé text 123 <|im_start|>user\nhi<|im_end|>\n"
    ids = tok(sample)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == sample, tok.decode(ids[1:])
    from unsloth_jax.data import chat_template_string

    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert tok.chat_template == chat_template_string("chatml")
    for t in SPECIAL_TOKENS:
        assert tok(t, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(t)], t
    print(f"  tokenizer OK: {type(tok).__name__}, {len(tok)} tokens")
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    for q in ["What is the capital of France?", "What day comes after Monday?", FACTS[0]["instruction"]]:
        enc = tok(alpaca_prompt(q), return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
        print(f"  {q!r} -> {tok.decode(out[0, enc['input_ids'].shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
