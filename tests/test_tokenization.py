"""Tests of rtrainer.tokenization: sources, determinism, TOK1 validation, batches, supervised masks, and the CLI.

Every input is built in a temporary folder; nothing here touches the network (the wiki source is tested
against a stand-in `huggingface_hub` module)."""
import json, os, random, re, secrets, shutil, struct, subprocess, sys, types, zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import rtrainer.tokenization as tk
from rtrainer.tokenization import EOT_ID, IGNORE_INDEX, VOCAB_SIZE, TokenFile
from rtrainer.cli import main as cli_main

WORDS = ["the", "model", "token", "shard", " spaces ", "\n\n", "naïve", "Zürich", "東京", "🙂", "<|endoftext|>",
         "3.14159", "x=1;", "don't", "(a, b)", "\t", "’", "—"]


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed {seed}")
    return random.Random(seed)


def random_documents(rng, count, max_words=80):
    return ["".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, max_words))) for _ in range(count)]


def write_parquet(path, texts, drop_text=False, row_group_size=5):
    n = len(texts)
    table = {"id": [str(i) for i in range(n)], "url": [f"https://example.invalid/{i}" for i in range(n)],
             "title": [f"Article {i}" for i in range(n)]}
    if not drop_text: table["text"] = texts
    pq.write_table(pa.table(table), path, row_group_size=row_group_size)
    return Path(path)


def write_jsonl(path, texts, field="text"):
    Path(path).write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return Path(path)


def expected_tokens(documents):
    encoding = tk.get_tokenizer()
    return np.array([t for ids in encoding.encode_ordinary_batch(documents) for t in ids + [EOT_ID]], dtype=np.uint16)


def shard_tokens_of(out_dir, manifest):
    "All tokens of a prepared folder in manifest order (validation first, then training)."
    return np.concatenate([TokenFile.open(Path(out_dir) / s["file"]).verify().tokens for s in manifest["shards"]])


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def run_cli(capsys, *argv):
    status = cli_main(["prepare", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------- vocabulary

def test_vocabulary_is_r50k_base_offline():
    encoding = tk.get_tokenizer()
    assert encoding.n_vocab == VOCAB_SIZE == 50257
    assert encoding.encode_ordinary("hello world") == [31373, 995]
    assert encoding.decode([EOT_ID]) == "<|endoftext|>"
    ids = encoding.encode_ordinary("x <|endoftext|> y")
    assert EOT_ID not in ids and encoding.decode(ids) == "x <|endoftext|> y"


def test_damaged_vocabulary_is_refused(tmp_path, monkeypatch):
    damaged = tmp_path / "r50k_base.tiktoken"
    data = bytearray(tk.vocab_path().read_bytes()); data[10] ^= 1
    damaged.write_bytes(bytes(data))
    monkeypatch.setattr(tk, "vocab_path", lambda: damaged)
    tk.get_tokenizer.cache_clear()
    try:
        with pytest.raises(ValueError, match="r50k_base.tiktoken: sha256 .* the vocabulary file is damaged"):
            tk.get_tokenizer()
    finally:
        monkeypatch.undo(); tk.get_tokenizer.cache_clear()
    assert tk.get_tokenizer().n_vocab == VOCAB_SIZE


# ---------------------------------------------------------------- sources and shards

def test_parquet_jsonl_text_sources_decode_to_documents_joined_by_eot(tmp_path, rng):
    documents = random_documents(rng, 60)
    parquet = write_parquet(tmp_path / "a.parquet", documents)
    jsonl = write_jsonl(tmp_path / "a.jsonl", documents)
    text_dir = tmp_path / "texts"; text_dir.mkdir()
    for i, d in enumerate(documents): (text_dir / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    joined = "".join(d + "<|endoftext|>" for d in documents)
    for source, inputs in [("parquet", [parquet]), ("jsonl", [jsonl]), ("text", [text_dir]), ("wiki", [parquet])]:
        out = tmp_path / f"out-{source}"
        manifest = tk.prepare_corpus(source, inputs, out, val_tokens=300, shard_tokens=1009, progress=False)
        tokens = shard_tokens_of(out, manifest)
        assert tk.get_tokenizer().decode(tokens.tolist()) == joined, source
        np.testing.assert_array_equal(tokens, expected_tokens(documents))
        assert manifest["documents"] == len(documents) and manifest["tokens"] == len(tokens)
        assert manifest["val_tokens"] == 300 and manifest["shards"][0]["file"] == f"{source}-val-00000.tok"
        assert [s["tokens"] for s in manifest["shards"][1:-1]] == [1009] * (len(manifest["shards"]) - 2)
        assert json.loads((out / "manifest.json").read_text()) == manifest
        assert manifest["tokenizer"]["sha256"] == tk.VOCAB_SHA256
        assert int((tokens == EOT_ID).sum()) == len(documents)


def test_empty_and_null_documents_are_skipped(tmp_path):
    pq.write_table(pa.table({"text": ["one", None, "", "two"]}), tmp_path / "n.parquet")
    manifest = tk.prepare_corpus("parquet", [tmp_path / "n.parquet"], tmp_path / "out", progress=False)
    assert manifest["documents"] == 2
    np.testing.assert_array_equal(shard_tokens_of(tmp_path / "out", manifest), expected_tokens(["one", "two"]))


def test_parquet_is_streamed_a_record_batch_at_a_time(tmp_path, monkeypatch, rng):
    documents = random_documents(rng, 40)
    path = write_parquet(tmp_path / "big.parquet", documents, row_group_size=4)
    def refuse(*args, **kwargs): raise AssertionError("the whole parquet file was read at once")
    monkeypatch.setattr(pq.ParquetFile, "read", refuse)
    monkeypatch.setattr(pq, "read_table", refuse)
    monkeypatch.setattr(tk, "PARQUET_BATCH_ROWS", 3)
    batches = []
    real_iter = pq.ParquetFile.iter_batches
    def counting(self, *args, **kwargs):
        assert kwargs.get("columns") == ["text"]
        for batch in real_iter(self, *args, **kwargs): batches.append(batch.num_rows); yield batch
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting)
    manifest = tk.prepare_corpus("parquet", [path], tmp_path / "out", progress=False)
    assert manifest["documents"] == 40 and max(batches) <= 3 and sum(batches) == 40


def test_limit_files_and_limit_articles(tmp_path, rng):
    folder = tmp_path / "parquets"; folder.mkdir()
    parts = [random_documents(rng, 7) for _ in range(3)]
    for i, docs in enumerate(parts): write_parquet(folder / f"part-{i}.parquet", docs)
    manifest = tk.prepare_corpus("parquet", [folder], tmp_path / "two", limit_files=2, progress=False)
    assert manifest["documents"] == 14 and len(manifest["inputs"]) == 2
    manifest = tk.prepare_corpus("parquet", [folder], tmp_path / "ten", limit_articles=10, progress=False)
    assert manifest["documents"] == 10
    np.testing.assert_array_equal(shard_tokens_of(tmp_path / "ten", manifest), expected_tokens((parts[0] + parts[1])[:10]))


def test_determinism_across_worker_counts(tmp_path, monkeypatch, rng):
    monkeypatch.setattr(tk, "ENCODE_TASK_CHARS", 211)   # many small tasks in flight at once
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", random_documents(rng, 400))
    results = {}
    for workers in (1, 2, 3, 8):
        out = tmp_path / f"w{workers}"
        tk.prepare_corpus("jsonl", [jsonl], out, name="corpus", val_tokens=777, shard_tokens=4001, workers=workers, progress=False)
        results[workers] = folder_bytes(out)
    assert len(results[1]) > 4                              # manifest, validation and several training shards
    for workers in (2, 3, 8): assert results[workers] == results[1]


def test_small_corpus_holds_back_a_tenth_and_empty_corpus_fails(tmp_path):
    manifest = tk.prepare_corpus("jsonl", [write_jsonl(tmp_path / "s.jsonl", ["a short corpus", "of two documents"])],
                                 tmp_path / "out", progress=False)
    assert [s["split"] for s in manifest["shards"]] == ["val", "train"]
    assert manifest["val_tokens"] == max(1, manifest["tokens"] // 10) and manifest["train_tokens"] > 0
    with pytest.raises(ValueError, match="the corpus is empty"):
        tk.prepare_corpus("jsonl", [write_jsonl(tmp_path / "e.jsonl", ["", ""])], tmp_path / "empty", progress=False)
    assert list((tmp_path / "empty").iterdir()) == []


def test_bundled_python_docs_corpus(tmp_path, capsys):
    manifest = tk.prepare_corpus("python-docs", [], tmp_path / "python-docs")
    out = capsys.readouterr().out
    assert [s["file"] for s in manifest["shards"]] == ["python-docs-val-00000.tok", "python-docs-train-00000.tok"]
    assert manifest["documents"] > 150 and manifest["tokens"] > 200_000
    assert manifest["val_tokens"] == manifest["tokens"] // 10
    for word in ("python-docs", "documents", "tokens", "shards", "validation", "tokens/s", f"{manifest['tokens']:,}"):
        assert word in out
    from pydoc_data.topics import topics
    first_topic = topics[sorted(topics)[0]]
    val = TokenFile.open(tmp_path / "python-docs" / "python-docs-val-00000.tok").verify()
    assert tk.get_tokenizer().decode(val.tokens[:2000].tolist()).startswith(first_topic[:1000])


# ---------------------------------------------------------------- atomic writing and resume

def test_interrupted_prepare_keeps_the_old_dataset_and_finishes_identically(tmp_path, monkeypatch, rng):
    "Interrupted, `prepare` leaves the dataset that was there whole; run again, it moves the shards it had staged into place."
    monkeypatch.setattr(tk, "ENCODE_TASK_CHARS", 300)     # small tasks, so shards complete before the interruption
    jsonl = write_jsonl(tmp_path / "c.jsonl", random_documents(rng, 300))
    arguments = dict(name="c", val_tokens=500, shard_tokens=2003, progress=False)
    tk.prepare_corpus("jsonl", [jsonl], tmp_path / "fresh", **arguments)

    out = tmp_path / "resumed"
    tk.prepare_corpus("jsonl", [write_jsonl(tmp_path / "old.jsonl", random_documents(rng, 60))], out, **arguments)
    old = folder_bytes(out)                                   # the dataset an interrupted run must not damage
    (out / ".c-train-00007.tok.tmp").write_bytes(b"junk")     # a temporary file that an older version's crash left
    real = tk.jsonl_documents
    def interrupted(paths, text_field="text"):
        for i, text in enumerate(real(paths, text_field)):
            if i == 200: raise KeyboardInterrupt
            yield text
    monkeypatch.setattr(tk, "jsonl_documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tk.prepare_corpus("jsonl", [jsonl], out, **arguments)
    monkeypatch.setattr(tk, "jsonl_documents", real)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".c-train-00007.tok.tmp"} == old
    assert tk.read_dataset(out)["manifest"]["documents"] == 60
    staging = out / tk.STAGING_NAME
    complete = sorted(p.name for p in staging.iterdir() if p.name.endswith(".tok") and not p.name.startswith("."))
    assert len(complete) >= 3 and not any(p.name.endswith(".tmp") for p in staging.iterdir())
    for name in complete: TokenFile.open(staging / name).verify()  # whatever is named like a shard is whole
    before = {name: (staging / name).stat() for name in complete}

    tk.prepare_corpus("jsonl", [jsonl], out, **arguments)
    for name, stat in before.items():                         # staged shards were moved into place, not rewritten
        assert (out / name).stat().st_ino == stat.st_ino and (out / name).stat().st_mtime_ns == stat.st_mtime_ns
    assert folder_bytes(out) == folder_bytes(tmp_path / "fresh")


def test_stale_shards_of_a_larger_earlier_run_are_removed(tmp_path, rng):
    jsonl = write_jsonl(tmp_path / "c.jsonl", random_documents(rng, 100))
    first = tk.prepare_corpus("jsonl", [jsonl], tmp_path / "out", name="c", val_tokens=100, shard_tokens=500, progress=False)
    (tmp_path / "out" / "other-train-00000.tok").write_bytes(b"not ours")
    second = tk.prepare_corpus("jsonl", [jsonl], tmp_path / "out", name="c", val_tokens=100, shard_tokens=10**6, progress=False)
    assert len(first["shards"]) > 3 and len(second["shards"]) == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["manifest.json", "other-train-00000.tok"] + [s["file"] for s in second["shards"]])


def test_a_failing_source_leaves_no_temporary_or_partial_shard(tmp_path):
    lines = [json.dumps({"text": f"document number {i} " * 20}) for i in range(50)] + ["{broken"]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:51: not valid JSON"):
        tk.prepare_corpus("jsonl", [tmp_path / "bad.jsonl"], tmp_path / "out", val_tokens=10, shard_tokens=100, progress=False)
    names = [p.name for p in (tmp_path / "out").iterdir()]
    assert not any(n.endswith(".tmp") for n in names) and "manifest.json" not in names
    for n in names: TokenFile.open(tmp_path / "out" / n).verify()


# ---------------------------------------------------------------- wiki source, without the network

def fake_hub(tmp_path, files, online=True):
    "A stand-in for huggingface_hub: lists `files` (name -> local parquet) online, or serves a cache snapshot offline."
    calls = []
    snapshot = tmp_path / "hf-snapshot"
    (snapshot / "20231101.en").mkdir(parents=True, exist_ok=True)
    for name, path in files.items(): shutil.copy(path, snapshot / name)
    def list_repo_files(repo_id, repo_type=None, **kwargs):
        assert (repo_id, repo_type) == ("wikimedia/wikipedia", "dataset")
        if not online: raise ConnectionError("offline")
        return ["README.md", "20231101.de/train-00000-of-00020.parquet", *files]
    def hf_hub_download(repo_id, filename, repo_type=None, **kwargs):
        calls.append(filename); return str(files[filename])
    def snapshot_download(repo_id, repo_type=None, allow_patterns=None, local_files_only=False, **kwargs):
        assert local_files_only and allow_patterns == ["20231101.en/*.parquet"]
        return str(snapshot)
    module = types.SimpleNamespace(list_repo_files=list_repo_files, hf_hub_download=hf_hub_download,
                                   snapshot_download=snapshot_download)
    return module, calls


def test_wiki_downloads_lazily_and_respects_limit_files(tmp_path, monkeypatch, rng):
    parts = [random_documents(rng, 6) for _ in range(3)]
    files = {f"20231101.en/train-0000{i}-of-00041.parquet": write_parquet(tmp_path / f"p{i}.parquet", d) for i, d in enumerate(parts)}
    hub, calls = fake_hub(tmp_path, files)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    manifest = tk.prepare_corpus("wiki", [], tmp_path / "out", limit_files=2, progress=False)
    assert calls == list(files)[:2] and manifest["inputs"] == list(files)[:2]
    np.testing.assert_array_equal(shard_tokens_of(tmp_path / "out", manifest), expected_tokens(parts[0] + parts[1]))


def test_wiki_offline_reads_the_cache(tmp_path, monkeypatch, rng):
    documents = random_documents(rng, 9)
    files = {"20231101.en/train-00000-of-00041.parquet": write_parquet(tmp_path / "p.parquet", documents)}
    hub, calls = fake_hub(tmp_path, files, online=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    manifest = tk.prepare_corpus("wiki", [], tmp_path / "out", progress=False)
    assert calls == [] and manifest["documents"] == 9


def test_wiki_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)      # not installed
    status, out, err = run_cli(capsys, "--source", "wiki", "--out", tmp_path / "out")
    assert status == 2 and "huggingface_hub" in err and "pip install" in err and len(err.splitlines()) == 1
    hub, _ = fake_hub(tmp_path, {}, online=False)                   # offline with an empty cache
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    status, out, err = run_cli(capsys, "--source", "wiki", "--out", tmp_path / "out")
    assert status == 2 and "no files are in the Hugging Face cache" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- TOK1 header validation

@pytest.fixture
def shard(tmp_path):
    n = 777 + secrets.randbelow(2000)
    writer = tk.ShardWriter(tmp_path / "s-train-00000.tok"); writer.write(np.arange(n)); writer.finish()
    return tmp_path / "s-train-00000.tok"


def corrupt(path, data, name):
    target = path.with_name(name); target.write_bytes(data); return target


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:63], "truncated: 63 bytes is shorter than the 64-byte TOK1 header"),
    (lambda b: b[:-1], "truncated: the header promises"),
    (lambda b: b + b"\0\0", "unexpected bytes after the"),
    (lambda b: b"GGUF" + b[4:], "not a TOK1 token file (starts with b'GGUF'"),
    (lambda b: b[:4] + struct.pack("<I", 2) + b[8:], "TOK1 version 2 is not supported"),
    (lambda b: b[:8] + struct.pack("<I", 4) + b[12:], "4 bytes per token"),
    (lambda b: b[:12] + struct.pack("<I", 100277) + b[16:], "vocabulary size 100277 does not match r50k_base (50257)"),
    (lambda b: b[:28] + struct.pack("<I", 0) + b[32:], "end-of-text id 0 does not match"),
    (lambda b: b[:40] + b"\1" + b[41:], "reserved and must be zero"),
])
def test_header_validation_messages(shard, mutate, message):
    bad = corrupt(shard, mutate(shard.read_bytes()), "bad.tok")
    with pytest.raises(ValueError) as error:
        TokenFile.open(bad)
    assert message in str(error.value) and str(error.value).startswith(str(bad)) and "\n" not in str(error.value)


def test_crc_and_missing_file(shard):
    data = bytearray(shard.read_bytes()); data[64 + 2 * 5] ^= 0x10
    bad = corrupt(shard, bytes(data), "flipped.tok")
    opened = TokenFile.open(bad)                       # the header is fine; only verify() reads the payload
    with pytest.raises(ValueError, match=r"flipped.tok: CRC-32 mismatch"):
        opened.verify()
    with pytest.raises(FileNotFoundError, match="nope.tok: no such token file"):
        TokenFile.open(shard.with_name("nope.tok"))
    assert TokenFile.open(shard).verify() is not None


def test_header_layout_is_the_documented_one(shard):
    raw = shard.read_bytes()
    n = (len(raw) - 64) // 2
    assert raw[:4] == b"TOK1"
    assert struct.unpack_from("<IIIQII", raw, 4) == (1, 2, 50257, n, zlib.crc32(raw[64:]), 50256)
    assert raw[32:64] == bytes(32)
    np.testing.assert_array_equal(np.frombuffer(raw[64:], "<u2"), np.arange(n))


# ---------------------------------------------------------------- batch and chunk

def test_batch_depends_only_on_seed_and_step(shard):
    a, b = TokenFile.open(shard, seed=3), TokenFile.open(shard, seed=3)
    B, T = 5, 37
    later = a.batch(9, B, T)
    for step in (4, 1, 0): b.batch(step, B, T)       # other calls in between change nothing
    x, y = b.batch(9, B, T)
    assert torch.equal(x, later[0]) and torch.equal(y, later[1])
    assert x.dtype == torch.int64 and x.shape == (B, T) and y.shape == (B, T)
    assert torch.equal(x + 1, y)                      # positional shard: targets are inputs shifted by one
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(B, T - 1, dtype=torch.int64))   # contiguous windows
    assert int(y.max()) < len(a)
    assert not torch.equal(a.batch(10, B, T)[0], x)
    assert not torch.equal(TokenFile.open(shard, seed=4).batch(9, B, T)[0], x)


def test_batch_ranks_are_disjoint_draws_of_the_global_batch(shard):
    f = TokenFile.open(shard, seed=11)
    for world_size in (2, 3):
        parts = [f.batch(6, 4, 21, rank, world_size) for rank in range(world_size)]
        whole = f.batch(6, 4 * world_size, 21)
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        f.batch(0, 2, 8, rank=2, world_size=2)


def test_batch_offsets_cover_the_shard(shard):
    f = TokenFile.open(shard, seed=0)
    T = 16
    starts = torch.cat([f.batch(step, 64, T)[0][:, 0] for step in range(50)])
    assert int(starts.min()) < len(f) * 0.05 and int(starts.max()) > (len(f) - T - 1) * 0.95
    assert int(starts.max()) <= len(f) - T - 1


@pytest.mark.parametrize("B, T, world_size", [(1, 1, 1), (3, 17, 1), (7, 64, 1), (2, 31, 3), (4, 5, 2), (16, 1000, 1)])
def test_chunk_covers_every_token_exactly_once(shard, B, T, world_size):
    f = TokenFile.open(shard)
    n = len(f)
    targets_seen, inputs_seen = [], []
    for rank in range(world_size):
        i = 0
        while (batch := f.chunk(i, B, T, rank, world_size)) is not None:
            x, y = batch
            assert x.shape == y.shape and x.shape[1] == T and 1 <= x.shape[0] <= B
            real = y != IGNORE_INDEX
            assert torch.equal(x[real] + 1, y[real])
            targets_seen += y[real].tolist(); inputs_seen += x[real].tolist()
            i += 1
        assert i == f.chunk_count(B, T, rank, world_size)
        assert f.chunk(i + 5, B, T, rank, world_size) is None
    assert sorted(targets_seen) == list(range(1, n))          # every position 1..n-1 once
    assert sorted(inputs_seen) == list(range(0, n - 1))


def test_chunk_ranks_partition_the_single_process_walk(shard):
    f = TokenFile.open(shard)
    for i in range(f.chunk_count(6, 13)):
        whole = f.chunk(i, 6, 13)
        parts = [p for p in (f.chunk(i, 2, 13, r, 3) for r in range(3)) if p is not None]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


def test_window_larger_than_shard_is_an_error(tmp_path):
    writer = tk.ShardWriter(tmp_path / "tiny.tok"); writer.write(np.arange(10)); writer.finish()
    with pytest.raises(ValueError, match="tiny.tok: 10 tokens are too few for one window of 11"):
        TokenFile.open(tmp_path / "tiny.tok").batch(0, 1, 10)
    assert TokenFile.open(tmp_path / "tiny.tok").batch(0, 2, 9)[0].shape == (2, 9)


# ---------------------------------------------------------------- supervised batches

def test_supervised_masks(rng):
    pairs = [([rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 13))],
              [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(2, 11))]) for _ in range(9)]
    x, y, mask = tk.supervised_batch(pairs, pad_id=7)
    width = max(len(p) + len(r) for p, r in pairs) - 1
    assert x.shape == y.shape == mask.shape == (9, width) and mask.dtype == torch.bool
    for row, (p, r) in enumerate(pairs):
        sequence = p + r
        assert y[row, :len(sequence) - 1].tolist() == sequence[1:]
        assert x[row, :len(sequence) - 1].tolist() == sequence[:-1]
        assert (y[row, len(sequence) - 1:] == 7).all() and not mask[row, len(sequence) - 1:].any()
        expected = [len(p) <= t + 1 for t in range(len(sequence) - 1)]
        assert mask[row, :len(sequence) - 1].tolist() == expected
        assert y[row][mask[row]].tolist() == (r if p else r[1:])


def test_supervised_errors(tmp_path):
    with pytest.raises(ValueError, match="pair 2: the response is empty"):
        tk.supervised_batch([([1], [2]), ([3], [4, 5]), ([6, 7], [])])
    with pytest.raises(ValueError, match="pair 0: token id 50257 is outside the vocabulary"):
        tk.supervised_batch([([1, 50257], [2])])
    with pytest.raises(ValueError, match="at least one"):
        tk.supervised_batch([])
    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c", "response": 3}\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:3: needs string fields 'prompt' and 'response'"):
        tk.load_sft_jsonl(path)
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c",\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:2: not valid JSON"):
        tk.load_sft_jsonl(path)
    with pytest.raises(FileNotFoundError, match="absent.jsonl: no such file"):
        tk.load_sft_jsonl(tmp_path / "absent.jsonl")
    path.write_text('{"prompt": "Question?", "response": " Answer."}\n')
    encoding = tk.get_tokenizer()
    [(prompt, response)] = tk.load_sft_jsonl(path)
    assert prompt == encoding.encode_ordinary("Question?") and response == encoding.encode_ordinary(" Answer.") + [EOT_ID]


# ---------------------------------------------------------------- the command line

def assert_one_line_error(status, err, *fragments):
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rtrainer prepare: error: "), err
    for fragment in fragments: assert fragment in lines[0], (fragment, lines[0])


def no_shards(folder):
    return not Path(folder).exists() or not any(p.suffix in (".tok", ".tmp") for p in Path(folder).iterdir())


def test_cli_success_prints_summary(tmp_path, capsys, rng):
    documents = random_documents(rng, 30)
    text_dir = tmp_path / "t"; text_dir.mkdir()
    for i, d in enumerate(documents): (text_dir / f"{i:02d}.txt").write_text(d)
    status, out, err = run_cli(capsys, "--source", "text", "--input", text_dir, "--out", tmp_path / "out",
                               "--name", "mine", "--val-tokens", 100, "--shard-tokens", 300, "--workers", 2)
    assert status == 0, err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["name"] == "mine" and manifest["documents"] == 30
    assert f"{manifest['tokens']:,}" in out and "tokens/s" in out and "mine-val-00000.tok" in out


def test_cli_missing_input(tmp_path, capsys):
    status, out, err = run_cli(capsys, "--source", "jsonl", "--input", tmp_path / "missing.jsonl", "--out", tmp_path / "out")
    assert_one_line_error(status, err, "missing.jsonl", "no such file")
    assert not (tmp_path / "out").exists()
    status, out, err = run_cli(capsys, "--source", "parquet", "--out", tmp_path / "out")
    assert_one_line_error(status, err, "needs at least one --input")
    empty_folder = tmp_path / "nothing-here"; empty_folder.mkdir()
    status, out, err = run_cli(capsys, "--source", "text", "--input", empty_folder, "--out", tmp_path / "out")
    assert_one_line_error(status, err, "nothing-here", "no *.txt files")


def test_cli_parquet_without_text_column(tmp_path, capsys):
    good = write_parquet(tmp_path / "good.parquet", ["fine text"] * 3)
    bad = write_parquet(tmp_path / "notext.parquet", ["x"] * 3, drop_text=True)
    status, out, err = run_cli(capsys, "--source", "parquet", "--input", good, bad, "--out", tmp_path / "out")
    assert_one_line_error(status, err, "notext.parquet", "no column 'text'", "id, url, title")
    assert no_shards(tmp_path / "out")
    (tmp_path / "junk.parquet").write_bytes(b"this is not parquet")
    status, out, err = run_cli(capsys, "--source", "parquet", "--input", tmp_path / "junk.parquet", "--out", tmp_path / "out")
    assert_one_line_error(status, err, "junk.parquet", "not a readable parquet file")


def test_cli_unwritable_output_folder(tmp_path, capsys, monkeypatch):
    jsonl = write_jsonl(tmp_path / "c.jsonl", ["some text"])
    (tmp_path / "a-file").write_text("I am a file")
    status, out, err = run_cli(capsys, "--source", "jsonl", "--input", jsonl, "--out", tmp_path / "a-file")
    assert_one_line_error(status, err, "a-file", "exists and is not a folder")
    status, out, err = run_cli(capsys, "--source", "jsonl", "--input", jsonl, "--out", tmp_path / "a-file" / "below")
    assert_one_line_error(status, err, "below", "part of its path is a file")
    locked = tmp_path / "locked"; locked.mkdir()
    if os.geteuid() != 0:                     # root ignores permission bits, so this half runs only for normal users
        locked.chmod(0o500)
        try:
            status, out, err = run_cli(capsys, "--source", "jsonl", "--input", jsonl, "--out", locked)
            assert_one_line_error(status, err, "locked", "not writable")
        finally: locked.chmod(0o700)
    def denied(*args, **kwargs): raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tk.tempfile, "mkstemp", denied)
    status, out, err = run_cli(capsys, "--source", "jsonl", "--input", jsonl, "--out", locked)
    assert_one_line_error(status, err, "locked", "the output folder is not writable (Permission denied)")
    assert list(locked.iterdir()) == []


def test_cli_empty_corpus(tmp_path, capsys):
    text_dir = tmp_path / "blank"; text_dir.mkdir()
    (text_dir / "a.txt").write_text(""); (text_dir / "b.txt").write_text("")
    status, out, err = run_cli(capsys, "--source", "text", "--input", text_dir, "--out", tmp_path / "out")
    assert_one_line_error(status, err, "the corpus is empty", "blank")
    assert no_shards(tmp_path / "out")


def test_cli_other_user_errors(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "wrong field"}\n')
    status, out, err = run_cli(capsys, "--source", "jsonl", "--input", tmp_path / "bad.jsonl", "--out", tmp_path / "out")
    assert_one_line_error(status, err, "bad.jsonl:2", "no field 'text'")
    assert no_shards(tmp_path / "out")
    status, out, err = run_cli(capsys, "--source", "python-docs", "--input", tmp_path / "bad.jsonl", "--out", tmp_path / "o2")
    assert_one_line_error(status, err, "takes no --input")
    status, out, err = run_cli(capsys, "--out", tmp_path / "o3", "--val-tokens", -5)
    assert_one_line_error(status, err, "--val-tokens must be an integer >= 0")
    status, out, err = run_cli(capsys, "--out", tmp_path / "o4", "--name", "../escape")
    assert_one_line_error(status, err, "--name '../escape'")


def test_cli_error_in_a_real_process(tmp_path):
    command = [sys.executable, "-c", "import sys; from rtrainer.cli import main; sys.exit(main())",
               "prepare", "--source", "parquet", "--input", str(tmp_path / "absent.parquet"), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"rtrainer prepare: error: {tmp_path / 'absent.parquet'}: no such file or folder"]
    assert done.stdout == "" and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- nothing trusted blindly (issue #37)

def small_dataset(tmp_path, rng, name="d"):
    "A prepared folder of a few small shards from fresh random documents."
    jsonl = write_jsonl(tmp_path / f"{name}.jsonl", random_documents(rng, 120))
    out = tmp_path / name
    tk.prepare_corpus("jsonl", [jsonl], out, name=name, val_tokens=300, shard_tokens=1500, progress=False)
    return out


def test_a_damaged_shard_or_manifest_is_refused_naming_the_file(tmp_path, rng, capsys):
    "A flipped byte, an id past the vocabulary, a manifest that disagrees with its files or is not JSON: refused, one line naming the file."
    good = small_dataset(tmp_path, rng)
    assert len(tk.read_dataset(good)["train"]) >= 3
    def damaged(edit):
        folder = tmp_path / f"case{len(list(tmp_path.glob('case*')))}"
        shutil.copytree(good, folder); edit(folder); return folder
    def flip(folder):
        shard = sorted(folder.glob("d-train-*.tok"))[1]
        data = bytearray(shard.read_bytes()); data[tk.HEADER_BYTES + rng.randrange(len(data) - tk.HEADER_BYTES)] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(data))
    def past_vocabulary(folder):                 # a shard whose header and CRC agree, holding id 60000
        shard = sorted(folder.glob("d-train-*.tok"))[0]
        tokens = np.fromfile(shard, dtype="<u2", offset=tk.HEADER_BYTES); tokens[rng.randrange(tokens.size)] = 60000
        shard.unlink(); writer = tk.ShardWriter(shard); writer.write(tokens); info = writer.finish()
        manifest = json.loads((folder / "manifest.json").read_text())
        next(s for s in manifest["shards"] if s["file"] == shard.name)["crc32"] = info["crc32"]
        (folder / "manifest.json").write_text(json.dumps(manifest))
    def manifest_edit(change):
        def edit(folder):
            manifest = json.loads((folder / "manifest.json").read_text()); change(manifest)
            (folder / "manifest.json").write_text(json.dumps(manifest))
        return edit
    cases = [(flip, "d-train-00001.tok: CRC-32 mismatch"),
             (past_vocabulary, "token id 60000 is outside the vocabulary"),
             (manifest_edit(lambda m: m["shards"][2].update(crc32=m["shards"][2]["crc32"] ^ 4)), "d-train-00001.tok: holds"),
             (manifest_edit(lambda m: m["shards"][1].update(tokens=m["shards"][1]["tokens"] + 1)), "d-train-00000.tok: holds"),
             (manifest_edit(lambda m: m["tokenizer"].update(name="cl100k_base")), "manifest.json: tokenizer name"),
             (manifest_edit(lambda m: m["tokenizer"].update(vocab_size=50000)), "manifest.json: tokenizer vocab_size"),
             (manifest_edit(lambda m: m.update(tokens=m["tokens"] + 7)), "manifest.json: tokens is"),
             (manifest_edit(lambda m: m["shards"][1].update(file="../d/d-train-00000.tok")), "is not a file name in this folder"),
             (lambda f: (f / "manifest.json").write_text('{"format": "TOK1", "shards": ['), "manifest.json: not valid JSON"),
             (lambda f: (f / "manifest.json").write_text("[1, 2]"), "manifest.json: not a JSON object"),
             (lambda f: next(f.glob("d-train-*.tok")).unlink(), "no such token file")]
    for edit, message in cases:
        folder = damaged(edit)
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)): tk.read_dataset(folder)
    status = cli_main(["train", "--data", str(tmp_path / "case0"), "--steps", "1", "--batch-size", "2", "--seq-len", "8",
                       "--device", "cpu", "--no-progress", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "case0/d-train-00001.tok: CRC-32 mismatch" in err[0], err
    assert not (tmp_path / "run").exists()                     # refused before anything was written


def test_a_second_prepare_into_the_same_folder_is_refused(tmp_path, rng, capsys):
    "While one `prepare` holds a folder's lock (here a process holding it), another into that folder refuses at once."
    jsonl = write_jsonl(tmp_path / "c.jsonl", random_documents(rng, 30))
    out = tmp_path / "out"; out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(out / ".prepare.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        status, _, err = run_cli(capsys, "--source", "jsonl", "--input", jsonl, "--out", out)
        assert_one_line_error(status, err, "another `rtrainer prepare` is writing into this folder")
        assert sorted(p.name for p in out.iterdir()) == [".prepare.lock"]
    finally: holder.kill(); holder.wait()
    status, _, err = run_cli(capsys, "--source", "jsonl", "--input", jsonl, "--out", out)   # the holder is gone: it goes ahead
    assert status == 0, err
    assert tk.read_dataset(out)["manifest"]["documents"] == 30 and not (out / ".prepare.lock").exists()


def test_a_failed_prepare_leaves_the_old_dataset_whole(tmp_path, rng, monkeypatch):
    "A bad input line after several complete shards, or a full disk: the dataset that was there is left byte for byte."
    out = small_dataset(tmp_path, rng, name="c")
    before = folder_bytes(out)
    lines = [json.dumps({"text": text}) for text in random_documents(rng, 150)] + ["{broken"]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:151: not valid JSON"):
        tk.prepare_corpus("jsonl", [tmp_path / "bad.jsonl"], out, name="c", val_tokens=100, shard_tokens=400, progress=False)
    assert folder_bytes(out) == before
    class FullDisk:                                            # the fourth training shard's file: the disk is full
        def __init__(self, file): self.file = file
        def write(self, data): raise OSError(28, "No space left on device")
        def __getattr__(self, name): return getattr(self.file, name)
    real = tk.ShardWriter.__init__
    def opened(self, path):
        real(self, path)
        if self.path.name == "c-train-00003.tok": self.file = FullDisk(self.file)
    monkeypatch.setattr(tk.ShardWriter, "__init__", opened)
    with pytest.raises(OSError) as full:
        tk.prepare_corpus("jsonl", [tmp_path / "c.jsonl"], out, name="c", val_tokens=100, shard_tokens=300, progress=False)
    assert full.value.filename.endswith("c-train-00003.tok") and full.value.strerror == "No space left on device"
    assert folder_bytes(out) == before and tk.read_dataset(out)["manifest"]["shard_tokens"] == 1500


def test_binary_text_and_untrainable_sft_examples_are_refused(tmp_path):
    "NUL bytes are not text; an SFT response that is empty, or a prompt that leaves it outside --seq-len, has nothing to train on."
    (tmp_path / "nul.txt").write_bytes(b"\0" * 5000)
    with pytest.raises(ValueError, match="nul.txt: a NUL character at offset 0"): list(tk.text_documents([tmp_path / "nul.txt"]))
    write_jsonl(tmp_path / "nul.jsonl", ["fine", "bin\0ary"])
    with pytest.raises(ValueError, match="nul.jsonl:2: field 'text' holds a NUL"): list(tk.jsonl_documents([tmp_path / "nul.jsonl"]))
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"prompt": "Q: 1 + 1?", "response": " 2"}\n{"prompt": "Q: say nothing", "response": ""}\n')
    with pytest.raises(ValueError, match="sft.jsonl:2: the response is empty"): tk.load_sft_jsonl(sft)
    long_prompt = " ".join(["word"] * 40)
    sft.write_text(json.dumps({"prompt": "short", "response": " yes"}) + "\n" + json.dumps({"prompt": long_prompt, "response": " no"}) + "\n")
    assert len(tk.load_sft_jsonl(sft)) == 2
    with pytest.raises(ValueError, match=r"sft.jsonl:2: the prompt is 40 tokens, more than --seq-len 16"): tk.load_sft_jsonl(sft, seq_len=16)
    assert len(tk.load_sft_jsonl(sft, seq_len=40)) == 2           # 40 prompt tokens leave the response's first as target 40
