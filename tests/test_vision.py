"""Images in chat messages, through `kinfer-rpc` as a client spawns it: SmolLM2 loaded with a
vision projector (model/load's options.projector) reads a message's `images` through llama.cpp's
libmtmd. No vision model's weights can be had offline, so the projector is a generated one with
random weights (tests/modelgen/make_vision_projector.py): these tests show the plumbing (an image
read, encoded, its embeddings in the prompt, kept by its hash, refused where it cannot be read),
not that a model sees anything."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest
from make_vision_projector import make_vision_projector, png
from rpcclient import RpcClient, error_of
from store_helpers import MEDIA, OllamaStore, place

from kinfer_rpc import errors
from kinfer_rpc.default_plugins.llama import vision
from kinfer_rpc.host.store import embedded_default_path

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not vision.available()[0], reason=vision.available()[1] or "libmtmd is there"),
]

GREEDY = {"temperature": 0, "maxTokens": 8}


RED = png(40, 30, (200, 10, 10))
BLUE = png(24, 24, (10, 10, 220))


@pytest.fixture(scope="module")
def projector(tmp_path_factory):
    return make_vision_projector(tmp_path_factory.mktemp("vision") / "mmproj.gguf")


@pytest.fixture(scope="module")
def seeing(projector):
    """A server with SmolLM2 loaded with the projector (two slots)."""
    c = RpcClient.spawn()
    try:
        c.initialize()
        loaded = c.load_model(embedded_default_path(), contextLength=512, slots=2, projector=projector)
        yield c, loaded["model"]
    finally:
        c.close(timeout=10)
    c.assert_clean()  # every message as spec/metaModel.json says (model/status's images too)


def ask(client, model, images, text="What is in this picture?", **extra):
    message = {"role": "user", "content": text, "images": images}
    return client.request("inference/chat", {"model": model, "messages": [message], "options": GREEDY, **extra})


def image_counts(client, model):
    return client.call("model/status", {"model": model})["models"][0]["images"]


def test_an_image_is_read_and_encoded_once_by_its_content(seeing, tmp_path):
    client, model = seeing
    before = image_counts(client, model)
    first = ask(client, model, [base64.b64encode(RED).decode()])["result"]
    assert first["usage"]["promptTokens"] > 16  # the image's 16 positions and the text
    after = image_counts(client, model)
    assert after["encoded"] == before["encoded"] + 1 and after["cached"] == before["cached"]
    # the same image again, as a data: URL and as a file's path: the cache answers, not the encoder
    url = "data:image/png;base64," + base64.b64encode(RED).decode()
    again = ask(client, model, [url])["result"]
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    third = ask(client, model, [str(path)])["result"]
    counts = image_counts(client, model)
    assert counts["encoded"] == after["encoded"] and counts["cached"] == after["cached"] + 2, counts
    assert again["text"] == first["text"] == third["text"]
    assert again["usage"]["promptTokens"] == first["usage"]["promptTokens"]
    # another image is encoded
    other = ask(client, model, [base64.b64encode(BLUE).decode()])["result"]
    assert image_counts(client, model)["encoded"] == after["encoded"] + 1
    # the prefix pool shares the cells before the image, never the image's: the same image and
    # another one get as many cached tokens, fewer than the prompt up to the image's end
    assert other["usage"]["cachedTokens"] == again["usage"]["cachedTokens"] > 0, (other["usage"], again["usage"])
    assert again["usage"]["cachedTokens"] < again["usage"]["promptTokens"] - 16


def test_initialize_says_the_llama_backend_reads_images():
    with RpcClient.spawn() as client:
        features = client.initialize()["capabilities"]["backendFeatures"]["llama"]
        assert features["vision"] is True and "visionUnavailable" not in features
        client.close(timeout=10)


def test_the_image_reaches_the_model(seeing):
    """Two images, the same words: the first reply token's distribution differs (the projector's
    embeddings are in the prompt, not placeholders); the same image twice: it is the same."""
    client, model = seeing

    def first(image: bytes) -> list[float]:
        message = {"role": "user", "content": "What colour is it?", "images": [base64.b64encode(image).decode()]}
        options = {"temperature": 0, "maxTokens": 1, "logprobs": True, "topLogprobs": 5}
        reply = client.call("inference/chat", {"model": model, "messages": [message], "options": options})
        return [t["logprob"] for t in reply["logprobs"][0]["topLogprobs"]]

    red = first(RED)
    assert first(RED) == red and first(BLUE) != red


def test_images_take_their_place_among_the_turns(seeing):
    client, model = seeing
    b64 = base64.b64encode(RED).decode()
    messages = [
        {"role": "user", "content": "Two pictures.", "images": [b64, base64.b64encode(BLUE).decode()]},
        {"role": "assistant", "content": "I see them."},
        {"role": "user", "content": "And this one?", "images": [b64]},
    ]
    reply = client.call("inference/chat", {"model": model, "messages": messages, "options": GREEDY})
    assert reply["usage"]["promptTokens"] > 3 * 16
    # a text-only request after it: the prefix pool gives it no cells of the images' placeholders
    alone = [{"role": "user", "content": "Two pictures."}]
    text = client.call("inference/chat", {"model": model, "messages": alone, "options": GREEDY})
    assert text["usage"]["completionTokens"] >= 1


def test_streamed_and_concurrent_requests_with_images(seeing):
    client, model = seeing
    one = ask(client, model, [base64.b64encode(RED).decode()])["result"]
    rids = [
        client.request_async(
            "inference/chat",
            {
                "model": model,
                "messages": [{"role": "user", "content": "What is in this picture?", "images": [img]}],
                "options": GREEDY,
            },
        )
        for img in (base64.b64encode(RED).decode(), base64.b64encode(BLUE).decode())
    ]
    replies = [client.response(rid, timeout=60)["result"] for rid in rids]
    assert replies[0]["text"] == one["text"]  # the same reply beside another request's image


def test_what_is_not_an_image_is_refused(seeing, tmp_path):
    client, model = seeing
    bad = error_of(ask(client, model, ["not base64!"]))
    assert bad["code"] == errors.INVALID_PARAMS and bad["data"]["field"] == "messages[0].images[0]", bad
    for odd in ("a string", [123], [""], [None], ["data:image/png,raw"], ["data:image/png;base64,!!"], {"a": 1}):
        wrong = error_of(ask(client, model, odd))
        assert wrong["code"] == errors.INVALID_PARAMS and wrong["data"]["field"].startswith("messages[0].images"), wrong
    unreadable = error_of(ask(client, model, [base64.b64encode(b"no picture here").decode()]))
    assert unreadable["code"] == errors.INVALID_PARAMS and "image" in unreadable["message"], unreadable
    # a small file that would unpack into 1.6 GB of pixels is refused before it is decoded
    bomb = bytearray(png(1, 1, (0, 0, 0)))
    bomb[16:24] = (20000).to_bytes(4, "big") * 2
    huge = error_of(ask(client, model, [base64.b64encode(bytes(bomb)).decode()]))
    assert huge["code"] == errors.INVALID_PARAMS and "20000x20000" in huge["message"], huge
    os.mkfifo(tmp_path / "pipe.png")  # a reader would wait forever: never opened
    for path in (tmp_path / "pipe.png", "/dev/zero", tmp_path):
        never = error_of(ask(client, model, [str(path)]))
        assert never["code"] == errors.INVALID_PARAMS, never
    missing = error_of(ask(client, model, ["/no/such/picture.png"]))
    assert missing["code"] == errors.INVALID_PARAMS, missing
    marker = error_of(ask(client, model, [base64.b64encode(RED).decode()], text="<__media__> twice"))
    assert marker["code"] == errors.INVALID_PARAMS and marker["data"]["field"] == "messages[0].content", marker
    # the server goes on
    assert ask(client, model, [base64.b64encode(RED).decode()])["result"]["usage"]["completionTokens"] >= 1


def test_a_model_without_a_projector_refuses_images():
    with RpcClient.spawn() as client:
        client.initialize()
        model = client.load_model()["model"]
        err = error_of(ask(client, model, [base64.b64encode(RED).decode()]))
        assert err["code"] == errors.NOT_SUPPORTED, err
        assert err["data"] == {"field": "messages[0].images", "model": model}, err
        assert "projector" in err["message"]
        client.close(timeout=10)
        client.assert_clean()


def test_a_projector_that_is_not_there_is_refused(bare):
    err = error_of(
        bare.request("model/load", {"model": embedded_default_path(), "options": {"projector": "/no/such/mmproj.gguf"}})
    )
    assert err["code"] == errors.INVALID_PARAMS and err["data"]["field"] == "options.projector", err


def test_the_python_client_sends_bytes_and_paths(projector, tmp_path):
    from kinfer_rpc.client import Client

    path = tmp_path / "red.png"
    path.write_bytes(RED)
    with Client() as kinfer:
        model = kinfer.load(embedded_default_path(), contextLength=512, slots=1, projector=projector).model
        as_bytes = kinfer.chat([{"role": "user", "content": "What is it?", "images": [RED]}], model, **WIRE)
        as_path = kinfer.chat([{"role": "user", "content": "What is it?", "images": [path]}], model, **WIRE)
        assert as_bytes.text == as_path.text and as_bytes.usage.prompt_tokens > 16


WIRE = {"temperature": 0, "maxTokens": 8}


@pytest.fixture(scope="module")
def served(tmp_path_factory, projector):
    """`kinfer serve --http` with SmolLM2 loaded with the projector (through its socket)."""
    from served import BIN, Served

    from kinfer_rpc.client import Client

    home = tmp_path_factory.mktemp("http-vision")
    # an Ollama vision model: SmolLM2's blob and the projector as its projector layer
    ollama = OllamaStore(home / "ollama")
    src = Path(embedded_default_path())
    digest = "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    place(src, ollama.root / "blobs" / digest.replace(":", "-"))
    model_layer = {"mediaType": MEDIA + "model", "digest": digest, "size": src.stat().st_size}
    projector_layer = ollama.blob(Path(projector).read_bytes(), "projector")
    ollama.manifest("registry.ollama.ai/library/llava/7b", [model_layer, projector_layer])
    s = Served(home)
    try:
        attach = [str(BIN / "kinfer-rpc"), "--attach", "--socket", str(s.socket)]
        with Client(attach, env=s.env) as c:
            model = c.load(embedded_default_path(), contextLength=512, slots=2, projector=projector, keep_alive=-1)
        yield s, model.model
    finally:
        assert s.stop() == 0


def test_openai_image_url_parts_and_ollama_images(served, tmp_path):
    import ollama
    import openai

    s, model = served
    oa = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(RED).decode()
    parts = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], max_tokens=8, seed=1)
    assert r.usage.prompt_tokens > 16 and r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="image_url"):  # kinfer fetches nothing
        oa.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
        )
    client = ollama.Client(host=s.url)
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    reply = client.chat(
        model=model, messages=[{"role": "user", "content": "What is it?", "images": [path]}], options={"num_predict": 4}
    )
    assert reply.prompt_eval_count > 16
    gen = client.generate(model=model, prompt="What is it?", images=[RED], options={"num_predict": 4})
    assert gen.prompt_eval_count > 16
    # an Ollama model with a projector layer: shown as Ollama shows it, and it reads images
    assert "vision" in client.show("llava:7b").capabilities
    question = [{"role": "user", "content": "What is it?", "images": [RED]}]
    ollama_vision = client.chat(model="llava:7b", messages=question, options={"num_predict": 2})
    assert ollama_vision.prompt_eval_count > 16
    # a model without a projector: 400 naming the field
    with pytest.raises(openai.BadRequestError, match="images"):
        oa.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": parts}])


def test_kinfer_run_shows_the_images_a_prompt_names(projector, tmp_path):
    import os
    import subprocess
    import sys

    from kinfer_rpc.cli.chat import image_paths

    path = tmp_path / "red picture.png"
    path.write_bytes(RED)
    assert image_paths(f"What is in '{path}'?") == ("What is in ?", [str(path)])
    assert image_paths("What is in /no/such.png?") == ("What is in /no/such.png?", [])
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(KINFER_HOME=str(tmp_path / "home"), KINFER_MODELS=str(tmp_path / "models"))
    kinfer = os.path.join(os.path.dirname(sys.executable), "kinfer")
    question = f"Describe '{path}'"
    common = ["--temperature", "0", "--max-tokens", "4", "--context-length", "512"]
    seeing = subprocess.run(
        [kinfer, "run", embedded_default_path(), question, "--projector", projector, *common],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert seeing.returncode == 0, seeing.stderr
    assert f"Added image '{path}'" in seeing.stderr
    # a model without a projector gets the prompt as it was written
    blind = subprocess.run(
        [kinfer, "run", embedded_default_path(), question, *common],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert blind.returncode == 0 and "Added image" not in blind.stderr, blind.stderr
