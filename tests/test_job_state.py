"""A job's state is a value, moved by one function along one story: WAITING -> PROMPT ->
GENERATING -> DONE (or DONE from anywhere before it), never backwards, never twice."""

from __future__ import annotations

import pytest

from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine.job import GenerateOptions, Job, JobState
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.types import LoadOptions

GREEDY = SamplingOptions(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)


def test_only_the_moves_of_the_story_are_allowed():
    job = Job([1, 2, 3], GenerateOptions(max_tokens=4, sampling=GREEDY))
    assert job.state is JobState.WAITING
    with pytest.raises(RuntimeError, match="from waiting to generating"):
        job.move(JobState.GENERATING)
    job.move(JobState.PROMPT)
    with pytest.raises(RuntimeError):
        job.move(JobState.WAITING)
    job.move(JobState.GENERATING)
    job.move(JobState.DONE)
    with pytest.raises(RuntimeError, match="from done to done"):
        job.move(JobState.DONE)


@pytest.mark.model
def test_a_job_walks_the_story_through_a_real_engine():
    """A prompt longer than one pass reads over several steps (PROMPT), then generates."""
    opts = LoadOptions(context_length=256, slots=2, batch=16, ubatch=16, threads=2, gpu_layers=0)
    engine = Engine(lambda p: LlamaBackend().load(embedded_default_path(), opts, p), lambda fn: fn(), batch=16)
    engine.load_model()
    try:
        prompt = engine.model.tokenize("one two three four five six seven eight nine ten " * 4, True, False)
        assert len(prompt) > 32
        job = Job(prompt, GenerateOptions(max_tokens=5, sampling=GREEDY, ignore_eos=True))
        cancelled = Job(prompt[:8], GenerateOptions(max_tokens=50, sampling=GREEDY, ignore_eos=True))
        engine.submit(job)
        engine.submit(cancelled)
        seen = [job.state]
        for _ in range(200):
            if job.state is JobState.DONE and cancelled.state is JobState.DONE:
                break
            engine.step()
            if job.state is not seen[-1]:
                seen.append(job.state)
            if cancelled.state is JobState.GENERATING and not cancelled.cancelled:
                engine.cancel(cancelled)
        assert seen == [JobState.WAITING, JobState.PROMPT, JobState.GENERATING, JobState.DONE]
        assert job.stop_reason == "length" and len(job.generated) == 5
        assert cancelled.state is JobState.DONE and cancelled.stop_reason == "cancelled"
    finally:
        engine.stop()
        if engine.model is not None:
            engine.model.close()
