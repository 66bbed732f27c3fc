"""Embeddings, rerank and score: BERT encoders through the same core, frontends and HTTP workers.

Parity is with sentence-transformers (all-MiniLM-L6-v2 from PyPI; a tiny random cross-encoder
written here); a vector never depends on what it was batched with; bad input is refused naming
its field, before anything is queued.
"""

from __future__ import annotations

import base64
import random
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest

from tests.serving import assert_openai_error, serve
from unison import Engine
from unison.errors import InvalidParam

WORDS = ("the a cat dog runs over under quickly slowly house river bank money tree green blue "
         "embedding vector search query document engine model token retrieval ranks apple orange "
         "mountain computer science history music plays reads writes city light night morning").split()


def sentences(n: int, seed: int, most: int = 300) -> list[str]:
    """Mixed lengths in words, from a few tokens to past the model's 256 (truncated alike on both
    sides) with the default `most`."""
    rng = random.Random(seed)
    lengths = [rng.choice([k for k in (2, 5, 9, 20, 40, 80, 150, 300) if k <= most]) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


@pytest.fixture(scope="module")
def minilm() -> Path:
    from tests.models import minilm_dir

    return minilm_dir()


@pytest.fixture(scope="module")
def st_model(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def engine(minilm):
    # A small token budget: batches of many sizes, and long sequences alone (never split). Torch's
    # own thread count: with 2 threads a GEMM's rows of 1 to 3 differ with its M (1 thread: not).
    with Engine(model_path=str(minilm), chunked_prefill_size=96) as e:
        yield e


def vectors(results: list[dict]) -> np.ndarray:
    return np.array([r["embedding"] for r in results], dtype=np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_vectors_match_sentence_transformers(engine, st_model):
    texts = sentences(200, seed=0)
    ours = vectors(engine.encode(texts, truncate_prompt_tokens=256))
    ref = st_model.encode(texts, batch_size=32, convert_to_numpy=True)
    assert ours.shape == ref.shape == (200, 384)
    worst = cosines(ours, ref).min()
    assert worst >= 0.99999, worst
    lengths = [len(engine.tokenizer.encode(t)) for t in texts]
    assert min(lengths) <= 8 and max(lengths) > 256  # short and long texts, truncation included
    # Where the linears run as int8 (Unison's kernels) or bfloat16 (oneDNN): within 0.999, on a
    # third of the texts (of every length still).
    some = slice(0, 200, 3)
    assert min(lengths[some]) <= 8 and max(lengths[some]) > 256
    for kind in ({"quantization": "int8"}, {"dtype": "bfloat16"}):
        with Engine(model_path=str(engine.get_server_info()["model_path"]), num_threads=1, **kind) as e:
            got = vectors(e.encode(texts[some], truncate_prompt_tokens=256))
            assert cosines(got, ref[some]).min() >= 0.999, kind
    # Retrieval: the same top 10 documents, in the same order, for every query.
    queries, docs = sentences(12, seed=1, most=12), sentences(60, seed=2)
    q_ours, d_ours = vectors(engine.encode(queries)), vectors(engine.encode(docs, truncate_prompt_tokens=256))
    q_ref, d_ref = (st_model.encode(x, convert_to_numpy=True) for x in (queries, docs))
    for i in range(len(queries)):
        assert list(np.argsort(-(d_ours @ q_ours[i]))[:10]) == list(np.argsort(-(d_ref @ q_ref[i]))[:10])


def test_a_vector_has_the_same_bits_alone_and_in_any_batch(engine):
    texts = sentences(24, seed=3)
    alone = vectors([engine.encode(t, truncate_prompt_tokens=256) for t in texts])
    together = vectors(engine.encode(texts, truncate_prompt_tokens=256))
    reversed_ = vectors(engine.encode(texts[::-1], truncate_prompt_tokens=256))[::-1]
    assert np.array_equal(alone, together) and np.array_equal(alone, reversed_)
    # The shortest sequences too: one GEMM over a 1- to 3-row batch rounds otherwise than over many.
    short = [[101], [101, 102], [101, 7592, 102], [101, 2023, 2003, 1037, 3231, 102]]
    assert np.array_equal(vectors([engine.encode(ids) for ids in short]), vectors(engine.encode(short)))
    # ... and from threads at once, whose requests the scheduler mixes in its steps.
    results: dict[int, np.ndarray] = {}

    def run(k: int) -> None:
        results[k] = vectors(engine.encode(texts[k::4], truncate_prompt_tokens=256))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        assert np.array_equal(results[k], alone[k::4])
    # Token ids in, as text in; the engine counted them all as finished requests.
    ids = engine.tokenizer.encode(texts[0])
    assert engine.encode(ids)["embedding"] == engine.encode(texts[0])["embedding"]
    assert engine.encode(ids)["meta_info"] == {"prompt_tokens": len(ids)}
    stats = engine.get_server_info()["stats"]
    assert stats["num_finished"] >= 24 * 4 and stats["generation_tokens"] == 0


def test_bad_input_names_its_field_and_queues_nothing(engine, minilm):
    before = engine.get_server_info()["stats"]["num_finished"]
    cases = [("", "prompt", "empty"), (["ok", ""], "prompt", "prompt[1] is an empty string"),
             ([], "prompt", "non-empty"), ([[1, 2], "x", 7], "prompt", "prompt[2]"),
             ([101, 999999], "prompt", "token ids in"), ("word " * 300, "prompt", "at most 256")]
    for given, field, fragment in cases:
        with pytest.raises(InvalidParam, match=re.escape(fragment)) as e:
            engine.encode(given)
        assert e.value.field == field
    with pytest.raises(InvalidParam, match="dimensions") as e:
        engine.encode("hi", dimensions=128)
    assert e.value.field == "dimensions"
    with pytest.raises(InvalidParam, match="truncate_prompt_tokens"):
        engine.encode("hi", truncate_prompt_tokens=0)
    with pytest.raises(InvalidParam, match="serves 'embed'") as e:
        engine.generate("Hello")
    assert e.value.field == "model"
    with pytest.raises(InvalidParam, match="serves 'embed'"):
        engine.rerank("q", ["d"])
    assert engine.get_server_info()["stats"]["num_finished"] == before
    assert engine.get_server_info()["num_waiting"] == 0
    # A task the model cannot serve is refused at start, by name.
    with pytest.raises(Exception, match="task"):
        Engine(model_path=str(minilm), task="generate")


def test_an_embedding_call_to_a_generation_model_is_refused():
    with Engine(max_total_tokens=256) as gen:
        assert gen.get_server_info()["task"] == "generate"
        with pytest.raises(InvalidParam, match="serves 'generate'") as e:
            gen.encode("Hello")
        assert e.value.field == "model"


# ---- HTTP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_server(minilm):
    yield from serve("embeddings", str(minilm), workers=2)


def test_openai_client_embeddings_over_http(embed_server, engine):
    card = embed_server.get("/v1/models").json()["data"][0]
    assert card["task"] == "embed" and card["max_model_len"] == 256
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="none")
    texts = sentences(6, seed=4, most=40)
    r = client.embeddings.create(model=card["id"], input=texts)
    assert [d.index for d in r.data] == list(range(6))
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode(t)) for t in texts)
    # Two HTTP workers, one core: the same bits as the Engine's own frontend.
    assert np.array_equal(np.array([d.embedding for d in r.data], np.float32), vectors(engine.encode(texts)))
    b64 = embed_server.post("/v1/embeddings", {"input": texts[0], "encoding_format": "base64"}).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"),
                          np.array(r.data[0].embedding, np.float32))
    ids = engine.tokenizer.encode(texts[1])
    by_ids = embed_server.post("/v1/embeddings", {"input": [ids]}).json()
    assert by_ids["data"][0]["embedding"] == r.data[1].embedding


def test_bad_http_input_is_a_400_naming_the_field(embed_server):
    for body, param in [({"input": ""}, "input"), ({"input": ["a", ""]}, "input"),
                        ({"input": "word " * 300}, "input"), ({"input": "a", "dimensions": 8}, "dimensions"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "a", "colour": 1}, "colour")]:
        err = assert_openai_error(embed_server.post("/v1/embeddings", body), 400)
        assert err["param"] == param, (body, err)
    err = assert_openai_error(embed_server.post("/v1/chat/completions",
                                                {"messages": [{"role": "user", "content": "hi"}]}), 400)
    assert err["param"] == "model" and "/v1/embeddings" in err["message"]
    assert_openai_error(embed_server.post("/v1/embeddings", {"input": "a", "model": "gpt-4"}), 404)
    truncated = embed_server.post("/v1/embeddings", {"input": "word " * 300, "truncate_prompt_tokens": 256})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 256
    info = embed_server.server_info()
    assert info["num_waiting"] == info["num_running"] == 0


def test_ollama_embed_gives_the_same_vectors(embed_server, engine):
    """Ollama's /api/embed (and its older /api/embeddings): the Engine's vectors; `truncate`
    (Ollama's default) cuts a long input at the context, false refuses it naming `input`."""
    name = embed_server.get("/v1/models").json()["data"][0]["id"]
    texts = sentences(3, seed=7, most=40)
    client = ollama.Client(host=embed_server.url)
    r = client.embed(model=name, input=texts)
    assert r.prompt_eval_count == sum(len(engine.tokenizer.encode(t)) for t in texts)
    assert np.array_equal(np.array(r.embeddings, np.float32), vectors(engine.encode(texts)))
    assert list(client.embeddings(model=name, prompt=texts[0]).embedding) == list(r.embeddings[0])
    long = {"model": name, "input": "word " * 300}
    assert embed_server.post("/api/embed", long).status_code == 200
    refused = embed_server.post("/api/embed", long | {"truncate": False})
    assert refused.status_code == 400 and "input" in refused.json()["error"]
    shown = embed_server.post("/api/show", {"model": name}).json()
    assert shown["capabilities"] == ["embedding"]


# ---- cross-encoders: rerank and score ---------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(minilm, tmp_path_factory) -> Path:
    """A tiny random BertForSequenceClassification (one label) with MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=512, num_labels=1)
    path = tmp_path_factory.mktemp("cross-encoder")
    model = BertForSequenceClassification(config)
    for p in model.parameters():  # past the tiny init, so scores spread and order matters
        p.data.normal_(0, 0.2)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, path / name)
    return path


def test_rerank_and_score_match_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder

    query = "Which city is the capital of France?"
    docs = sentences(10, seed=5, most=60) + ["Paris is the capital of France."]
    ref = CrossEncoder(str(cross_encoder), device="cpu").predict([(query, d) for d in docs])
    with Engine(model_path=str(cross_encoder), num_threads=1) as e:
        assert e.get_server_info()["task"] == "rerank"
        scores = e.score(query, docs)
        assert np.abs(np.array(scores) - ref).max() <= 1e-4
        ranked = e.rerank(query, docs, top_n=3, return_documents=True)
        assert [r["index"] for r in ranked] == list(np.argsort(-ref)[:3])
        assert ranked[0]["document"] == {"text": docs[ranked[0]["index"]]}
        assert e.score(query, docs[0]) == scores[:1]
        with pytest.raises(InvalidParam, match="documents"):
            e.rerank(query, [])
        with pytest.raises(InvalidParam, match="top_n"):
            e.rerank(query, docs, top_n=0)
        with pytest.raises(InvalidParam, match="serves 'rerank'"):
            e.encode("hi")


@pytest.fixture(scope="module")
def rerank_server(cross_encoder):
    yield from serve("rerank", str(cross_encoder))


def test_rerank_routes(rerank_server):
    server = rerank_server
    query, docs = "capital of France", ["Cats purr.", "Paris is the capital of France.", "Rivers flow."]
    results = {}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = server.post(path, {"query": query, "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        results[path] = r.json()["results"]
        assert len(results[path]) == 2
        assert set(results[path][0]) == {"index", "relevance_score", "document"}
    assert results["/v1/rerank"] == results["/rerank"] == results["/v2/rerank"]
    score = server.post("/score", {"text_1": query, "text_2": docs}).json()
    by_index = {r["index"]: r["relevance_score"] for r in results["/rerank"]}
    assert all(score["data"][i]["score"] == s for i, s in by_index.items())
    err = assert_openai_error(server.post("/v1/rerank", {"query": query, "documents": [""]}), 400)
    assert err["param"] == "documents"
    err = assert_openai_error(server.post("/v1/embeddings", {"input": "x"}), 400)
    assert err["param"] == "model"


# ---- pooled decoders: Qwen3-Embedding's recipe ------------------------------------------------


@pytest.fixture(scope="module")
def pooled_decoder(tmp_path_factory, model_dir) -> Path:
    """A tiny random Qwen3 with the embedded model's tokenizer and sentence-transformers' modules
    as Qwen3-Embedding ships them (last-token pooling, then Normalize)."""
    import json

    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    hf = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    path = tmp_path_factory.mktemp("qwen3-embedding")
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, path / name)
    modules = [{"idx": i, "name": str(i), "path": path_, "type": f"sentence_transformers.models.{kind}"}
               for i, (path_, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                  ("2_Normalize", "Normalize")])]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    return path


def test_a_decoder_embeds_with_its_last_token(pooled_decoder):
    import torch
    import transformers

    texts = sentences(10, seed=6, most=80)
    hf = transformers.AutoModel.from_pretrained(pooled_decoder).eval()
    ref = []
    with Engine(model_path=str(pooled_decoder), chunked_prefill_size=16, max_total_tokens=4096,
                num_threads=1) as e:
        assert e.get_server_info()["task"] == "embed"
        with torch.inference_mode():
            for t in texts:
                last = hf(torch.tensor([e.tokenizer.encode(t)])).last_hidden_state[0, -1]
                ref.append(torch.nn.functional.normalize(last, dim=0).numpy())
        ours = vectors(e.encode(texts))  # prefilled in chunks of 16 tokens
        assert cosines(ours, np.array(ref)).min() >= 0.99999
        hits = e.get_server_info()["stats"]["prefix_cache_hits"]
        again = vectors(e.encode(texts))  # from the prefix cache, all but the last token
        assert e.get_server_info()["stats"]["prefix_cache_hits"] > hits
        assert cosines(again, ours).min() >= 0.99999
        with pytest.raises(InvalidParam, match="serves 'embed'"):
            e.generate("Hello")
    # On Unison's int8 kernels a row's bits never depend on its batch: alone = together = cached.
    with Engine(model_path=str(pooled_decoder), quantization="int8", chunked_prefill_size=16,
                max_total_tokens=4096, num_threads=1) as e:
        together = vectors(e.encode(texts))
        assert np.array_equal(together, vectors([e.encode(t) for t in texts]))
        assert np.array_equal(together, vectors(e.encode(texts[::-1]))[::-1])
        # (random 64-wide weights lose more to int8 than a trained model: MiniLM's bar is 0.999)
        assert cosines(together, np.array(ref)).min() >= 0.99


def test_a_decoder_reranks_by_yes_and_no(pooled_decoder, tmp_path):
    """Qwen3-Reranker's recipe on a tiny random Qwen3: P("yes") against "no" at the last token of
    the pair written into its prompt, as transformers computes it."""
    import torch
    import transformers

    from unison.model.pooling.encoder_config import QWEN3_RERANKER_TEMPLATE, RERANK_INSTRUCTION

    path = tmp_path / "reranker"
    shutil.copytree(pooled_decoder, path, ignore=shutil.ignore_patterns("modules.json", "1_Pooling"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    query, docs = "Which city is the capital of France?", sentences(5, seed=7, most=40)
    with Engine(model_path=str(path), task="rerank", max_total_tokens=4096, num_threads=1) as e:
        assert e.get_server_info()["task"] == "rerank"
        yes, no = (e.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
        ref = []
        with torch.inference_mode():
            for d in docs:
                text = QWEN3_RERANKER_TEMPLATE.format(instruction=RERANK_INSTRUCTION, query=query, document=d)
                logits = hf(torch.tensor([e.tokenizer.encode(text, add_special_tokens=False)])).logits[0, -1]
                ref.append(torch.softmax(logits[[no, yes]], dim=-1)[1].item())
        scores = e.score(query, docs)
        assert np.abs(np.array(scores) - ref).max() <= 1e-4
        assert [r["index"] for r in e.rerank(query, docs)] == list(np.argsort(-np.array(ref)))
        with pytest.raises(InvalidParam, match="serves 'rerank'"):
            e.generate("Hello")
