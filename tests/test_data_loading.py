"""Dataset loading and validation: file types, error messages (file + line), skip_bad_lines counts."""
from __future__ import annotations

import json
import logging

import pytest

from unsloth_jax.data import detect_format, load_records, validate_records
from unsloth_jax.errors import DatasetFormatError


def _write(path, lines):
    path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    return path


def _random_records(rng, n):
    recs = []
    for i in range(n):
        k = int(rng.integers(0, 3))
        if k == 0:
            recs.append({"text": f"doc {i} {rng.integers(1_000_000)}"})
        elif k == 1:
            recs.append({"instruction": f"q{i}", "input": "", "output": f"a{rng.integers(1000)}"})
        else:
            recs.append({"conversations": [{"from": "human", "value": f"hi {i}"},
                                           {"from": "gpt", "value": f"yo {rng.integers(1000)}"}]})
    return recs


def test_load_jsonl_json_and_directory(tmp_path, rng):
    recs = _random_records(rng, 9)
    f = _write(tmp_path / "a.jsonl", [json.dumps(r) for r in recs[:5]] + [""] + [json.dumps(r) for r in recs[5:]])
    out = load_records(f)
    assert out == recs and out.skipped == 0
    assert out.locations[5] == (str(f), 7)  # the blank line 6 is skipped, record 5 is on line 7

    (tmp_path / "list.json").write_text(json.dumps(recs))
    assert load_records(tmp_path / "list.json") == recs
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": recs}))
    assert load_records(tmp_path / "wrapped.json") == recs

    d = tmp_path / "dir"
    d.mkdir()
    _write(d / "b.jsonl", [json.dumps(r) for r in recs[4:]])
    _write(d / "a.jsonl", [json.dumps(r) for r in recs[:4]])
    (d / "notes.txt").write_text("ignored")
    got = load_records(d)
    assert got == recs  # files in sorted order
    assert got.locations[4] == (str(d / "b.jsonl"), 1)


@pytest.mark.parametrize("line, where", [('{"instruction": "a", "output": "b"', "the end of the line, column 35"),
                                         ('{"instruction": "a", "output": }', "column 32"),
                                         ('{"instruction": "a",, "output": "b"}', "column 21")])
def test_bad_json_column_is_on_the_bad_line(tmp_path, line, where):
    """Issue 48: the column of a malformed line is counted on that line (a line cut short used to be reported at
    column 1 of the next one)."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"instruction": "x", "output": "y"}\n' + line + '\n{"instruction": "z", "output": "w"}\n')
    with pytest.raises(DatasetFormatError) as e:
        load_records(f)
    assert f"{f}, line 2: invalid JSON" in str(e.value) and f"at {where})" in str(e.value), str(e.value)


def test_bad_line_names_file_and_line(tmp_path, rng, caplog):
    recs = _random_records(rng, 6)
    lines = [json.dumps(r) for r in recs]
    lines.insert(3, '{"text": "unterminated')   # line 4: bad JSON
    lines.insert(5, "[1, 2, 3]")                 # line 6: not an object
    f = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetFormatError) as e:
        load_records(f)
    msg = str(e.value)
    assert str(f) in msg and "line 4" in msg and "invalid JSON" in msg and "skip_bad_lines" in msg

    lines.pop(3)
    f2 = _write(tmp_path / "bad2.jsonl", lines)
    with pytest.raises(DatasetFormatError, match=r"bad2\.jsonl, line 5: expected a JSON object, got list"):
        load_records(f2)

    with caplog.at_level(logging.WARNING):
        got = load_records(f, skip_bad_lines=True)
    assert got == recs and got.skipped == 2
    assert "skipped 2 malformed line" in caplog.text


def test_bad_utf8_and_bad_json_file(tmp_path):
    f = tmp_path / "u.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DatasetFormatError, match=r"u\.jsonl, line 2: not valid UTF-8"):
        load_records(f)
    assert load_records(f, skip_bad_lines=True).skipped == 1

    j = tmp_path / "x.json"
    j.write_text('[\n {"text": "a"},\n {"text": }\n]')
    with pytest.raises(DatasetFormatError, match=r"x\.json, line 3: invalid JSON"):
        load_records(j)
    j.write_text('[{"text": "a"}, 5]')
    with pytest.raises(DatasetFormatError, match=r"x\.json, record 1: expected a JSON object"):
        load_records(j)
    assert load_records(j, skip_bad_lines=True).skipped == 1
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(DatasetFormatError, match="unsupported file type"):
        load_records(tmp_path / "data.csv")


def test_validate_missing_fields(tmp_path, rng, caplog):
    good = [{"instruction": f"do {i}", "output": f"done {rng.integers(100)}"} for i in range(4)]
    lines = [json.dumps(good[0]), json.dumps({"instruction": "no output here"}), json.dumps(good[1]),
             json.dumps({"instruction": "x", "input": "", "output": 3}), json.dumps(good[2])]
    f = _write(tmp_path / "alp.jsonl", lines)
    recs = load_records(f)
    with pytest.raises(DatasetFormatError) as e:
        validate_records(recs, "alpaca")
    msg = str(e.value)
    assert f"{f}, line 2" in msg and "missing field 'output'" in msg and "'input' may be empty" in msg
    with caplog.at_level(logging.WARNING):
        ok = validate_records(recs, "alpaca", skip_bad_lines=True)
    assert ok == good[:3] and ok.skipped == 2 and "skipped 2 record" in caplog.text
    assert ok.locations == [(str(f), 1), (str(f), 3), (str(f), 5)]

    # Plain lists: the record index (and the source when given) names the culprit.
    plain = [{"conversations": [{"from": "human", "value": "hi"}]},
             {"conversations": [{"from": "alien", "value": "x"}]}]
    with pytest.raises(DatasetFormatError, match=r"^mydata, record 1: conversations\[0\] has unknown role 'alien'"):
        validate_records(plain, "sharegpt", source="mydata")
    with pytest.raises(DatasetFormatError, match=r"^record 0: missing field 'messages'"):
        validate_records(plain, "chatml")
    with pytest.raises(DatasetFormatError, match=r"record 1: cannot detect the format"):
        validate_records([{"text": "a"}, {"foo": 1}], "auto")
    with pytest.raises(DatasetFormatError, match=r"record 0: field 'text' must be a non-empty string"):
        validate_records([{"text": ""}], "text")
    mixed = [{"text": "a"}, {"instruction": "i", "output": "o"}, {"messages": [{"role": "user", "content": "c"}]},
             {"conversations": [{"from": "gpt", "value": "v"}]}]
    assert validate_records(mixed, "auto") == mixed
    # Alpaca without `input` and with input None are fine.
    assert validate_records([{"instruction": "i", "output": "o", "input": None}], "alpaca").skipped == 0


def test_detect_format():
    assert detect_format({"text": "x"}) == "text"
    assert detect_format({"instruction": "x", "output": "y"}) == "alpaca"
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"messages": []}) == "chatml"
    assert detect_format({"body": "x"}, text_field="body") == "text"
    assert detect_format({"prompt": "x", "completion": "y"}) == "prompt_completion"
    assert detect_format({"prompt": [], "completion": []}) == "prompt_completion"
    assert detect_format({"prompt": "x"}) == "prompt_completion"  # validation names the missing completion
    assert detect_format({"text": "t", "prompt": "x", "completion": "y"}) == "text"  # as prepare_texts
    with pytest.raises(DatasetFormatError, match="cannot detect"):
        detect_format({"question": "x"})


@pytest.mark.parametrize("name,content", [("empty.jsonl", ""), ("blank.jsonl", "\n  \n\t\n"),
                                          ("empty.json", ""), ("list.json", "[]"), ("data.json", '{"data": []}')])
def test_file_without_records_names_the_file(tmp_path, name, content):
    """A file that holds no record raises DatasetFormatError naming it (it used to load as [] silently)."""
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(DatasetFormatError, match=rf"^{f}: holds no records \(the file is empty"):
        load_records(f)


def test_directory_or_skipped_lines_without_records(tmp_path, caplog):
    d = tmp_path / "shards"
    d.mkdir()
    with pytest.raises(DatasetFormatError, match=rf"^{d}: directory holds no \.jsonl files"):
        load_records(d)
    _write(d / "a.jsonl", [""])
    (d / "b.jsonl").write_text("")
    with pytest.raises(DatasetFormatError, match=rf"^{d}: directory's \.jsonl files hold no records \(a\.jsonl, "
                                                 r"b\.jsonl"):
        load_records(d)
    _write(d / "c.jsonl", [json.dumps({"text": "one"})])
    with caplog.at_level(logging.WARNING):
        assert load_records(d) == [{"text": "one"}]
    assert "2 file(s) hold no records: a.jsonl, b.jsonl" in caplog.text
    bad = _write(tmp_path / "bad.jsonl", ["{oops", "", "[1]"])
    with pytest.raises(DatasetFormatError, match=rf"^{bad}: holds no records: all 2 non-blank line\(s\) were "
                                                 "malformed"):
        load_records(bad, skip_bad_lines=True)


def test_prompt_completion_validation_names_file_and_line(tmp_path):
    """TRL's prompt-completion records, standard and conversational, validate; bad ones name file and line."""
    good = [{"prompt": "The sky is", "completion": " blue."},
            {"prompt": [{"role": "user", "content": "Sky colour?"}],
             "completion": [{"role": "assistant", "content": "Blue."}]},
            {"prompt": [], "completion": [{"role": "assistant", "content": "Hello."}]}]
    bad = [({"prompt": "x"}, "missing field 'completion'"),
           ({"completion": "y"}, "missing field 'prompt'"),
           ({"prompt": "x", "completion": ""}, "field 'completion' is empty"),
           ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]},
            "fields .prompt. and .completion. must be both strings .* got str and list"),
           ({"prompt": [{"role": "user", "content": "q"}], "completion": []},
            r"field 'completion' must be a non-empty list of turns"),
           ({"prompt": [{"role": "alien", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]},
            r"prompt\[0\] has unknown role 'alien'"),
           ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": 5}]},
            r"completion\[0\]\.content must be a string")]
    assert validate_records(good, "auto") == good
    assert validate_records(good, "prompt_completion") == good
    for rec, reason in bad:
        f = _write(tmp_path / "pc.jsonl", [json.dumps(good[0]), json.dumps(rec), json.dumps(good[1])])
        recs = load_records(f)
        for fmt in ("auto", "prompt_completion"):
            with pytest.raises(DatasetFormatError, match=rf"^{f}, line 2: {reason}"):
                validate_records(recs, fmt)
        assert validate_records(recs, skip_bad_lines=True).locations == [(str(f), 1), (str(f), 3)]


def _imported_modules(path) -> set[str]:
    """Every module a Python file imports, at any depth (function-level imports included)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_loading_and_formats_do_not_import_each_other():
    """Layering: unsloth_jax.data.loading and .formats share unsloth_jax.data.records, not each other."""
    from tests.helpers import ROOT

    data = ROOT / "unsloth_jax" / "data"
    assert "unsloth_jax.data.formats" not in _imported_modules(data / "loading.py")
    assert "unsloth_jax.data.loading" not in _imported_modules(data / "formats.py")
    assert not {"unsloth_jax.data.formats", "unsloth_jax.data.loading"} & _imported_modules(data / "records.py")
