"""The model-facing half of the server (``Backend``): prompt preparation off the event loop, submission, and
per-request events.

``Backend`` is what the HTTP routes talk to. It owns the text stack, knows the served model's limits, hands
each ``GenerationRequest`` to the step loop through the inbox (``dgpp.sched.thread_handoff``) and receives its
choices' events on an asyncio queue (the ``EventRelay`` drains the step loop's posts onto it). It never reads the
scheduler: ``/metrics`` reads what the step loop publishes (``published``). What the HTTP side counts itself
are the ``ServiceCounters`` and the ``RequestHistograms``.

The request histograms (latency and size, for ``/metrics/prometheus``, ``dgpp_request_*``) are observed on the
event loop when a choice's retirement event is drained (``EventRelay``, whoever is still reading the request),
from the timing the step loop sends with each event (arrival, admission, first and last token, token counts);
nothing of them runs on the step loop's thread.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from dgpp.media.prompt import PromptMedia
from dgpp.sample.params import SamplingDefaults
from dgpp.sched.request import RetireReason, SeqEvent, SeqTiming
from dgpp.sched.scheduler import QueueFull
from dgpp.sched.step_loop import StepLoop
from dgpp.sched.thread_handoff import (
    EngineInbox,
    EventRelay,
    GenerationRequest,
    StepLoopFailed,
    submitted,
)
from dgpp.serve.errors import APIError, overloaded
from dgpp.serve.generation import ModelLimits
from dgpp.serve.images import ImageInputs
from dgpp.serve.output_processor import OutputProcessor, prompt_opens_thinking
from dgpp.serve.validate import refuse_image_parts
from dgpp.text.errors import GrammarError, TextError


@dataclass
class ServiceCounters:
    """HTTP-side counters for ``/metrics`` ``service``."""

    requests_total: int = 0
    rejects_bad: int = 0
    requests_failed: int = 0
    tokens_out: int = 0
    tool_calls_out: int = 0

    def finished(self, outputs: list[Any]) -> None:
        self.tokens_out += sum(o.completion_tokens for o in outputs)
        self.tool_calls_out += sum(len(o.tool_calls) for o in outputs)


_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKENS = (1, 8, 32, 128, 512, 2048, 8192, 32768, 131072)


class RequestHistograms:
    """The ``dgpp_*`` request histograms, labelled ``model_name`` (TTFT also by ``prefix_cache`` hit/miss)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(
            auto_describe=False
        )  # ``PrometheusExport`` adds the scrape-time families
        registry = self.registry

        def hist(name: str, doc: str, buckets: tuple, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"dgpp_{name}", doc, ["model_name", *extra], buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "arrival to first token", _LATENCY, ("prefix_cache",))
        self.queue = hist("request_queue_time_seconds", "arrival to admission", _LATENCY)
        self.prefill = hist("request_prefill_time_seconds", "admission to first token", _LATENCY)
        self.decode = hist("request_decode_time_seconds", "first to last token", _LATENCY)
        self.e2e = hist("e2e_request_latency_seconds", "arrival to retirement", _LATENCY)
        self.tpot = hist("request_time_per_output_token_seconds", "mean gap between output tokens", _LATENCY)
        self.prompt = hist("request_prompt_tokens", "prompt tokens per sequence", _TOKENS)
        self.generation = hist("request_generation_tokens", "generated tokens per sequence", _TOKENS)

    def retired(self, t: SeqTiming, reason: RetireReason) -> None:
        """A choice retired just now (its last event reached the event loop)."""
        self.observe(t, reason, time.monotonic())

    def observe(self, t: SeqTiming, reason: RetireReason, now: float) -> None:
        m = self.model_name
        if reason is RetireReason.FAILED:
            return
        self.prompt.labels(m).observe(t.prompt_tokens)
        self.generation.labels(m).observe(t.output_tokens)
        self.e2e.labels(m).observe(now - t.arrival)
        if t.admitted_at is not None:
            self.queue.labels(m).observe(t.admitted_at - t.arrival)
        if t.first_token_at is None:
            return
        self.ttft.labels(m, "hit" if t.cached_tokens else "miss").observe(t.first_token_at - t.arrival)
        if t.admitted_at is not None:
            self.prefill.labels(m).observe(t.first_token_at - t.admitted_at)
        if t.last_token_at is not None:
            self.decode.labels(m).observe(t.last_token_at - t.first_token_at)
            if t.output_tokens > 1:
                self.tpot.labels(m).observe((t.last_token_at - t.first_token_at) / (t.output_tokens - 1))


@dataclass
class TextStack:
    """The checkpoint's text side: tokenizer, chat template, tool/reasoning dialect, grammar context."""

    tokenizer: Any
    template: Any = None
    dialect: Any = None
    grammar: Any = None
    images: Any = None  # the family's dgpp.media.prompt.ImageInput when the model reads images


@dataclass
class PreparedChat:
    """A chat request made ready off the event loop: prompt ids, how to route its output, and one grammar
    matcher per choice when something constrains it."""

    prompt_ids: list[int]
    prompt_text: str
    tools: list[dict] | None
    matchers: list[Any] | None = None
    constraint: dict[str, Any] | None = None  # what the matchers were built from (journaled under TP)
    media: PromptMedia | None = None  # the prompt's images (a model with a vision encoder)


@dataclass
class RequestHandle:
    """One submitted request and the queue its choices' events arrive on: ``(choice_index, SeqEvent)``."""

    request: GenerationRequest
    inbox: EngineInbox
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: set[int] = field(default_factory=set)  # choices the scheduler has retired
    cancelled: set[int] = field(default_factory=set)  # choices we asked the scheduler to stop

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    def cancel(self, choice: int | None = None, reason: RetireReason = RetireReason.CANCELLED) -> None:
        """Stop one choice (a stop string matched) or, with ``choice=None``, every unfinished choice."""
        for i in range(self.request.n) if choice is None else (choice,):
            if i not in self.done and i not in self.cancelled:
                self.cancelled.add(i)
                self.inbox.cancel(self.request.choice_id(i), reason)

    @property
    def finished(self) -> bool:
        return len(self.done) == self.request.n

    async def events(self) -> AsyncIterator[tuple[int, SeqEvent]]:
        """``(choice, event)`` as the events arrive, until every choice has retired (a retired choice is marked
        done before its last event is yielded)."""
        while not self.finished:
            choice, ev = await self.queue.get()
            if ev.retired is not None:
                self.done.add(choice)
            yield choice, ev


INLINE_PREP_CHARS = 8192  # prompts up to this many characters are prepared on the event loop (``_run_prep``)


def _message_chars(messages: list[Any]) -> int:
    """Characters of plain-text message contents; a non-text content counts as too many to prepare inline."""
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if content is None:
            continue
        if not isinstance(content, str):
            return INLINE_PREP_CHARS + 1
        total += len(content)
    return total


def _effort_mapping(template: Any) -> dict[str, Any]:
    """``/v1/models`` ``reasoning.effort_mapping``: what each reasoning effort sets in the chat template."""
    if template is None:
        return {}
    try:
        return template.effort_mapping()
    except Exception:  # a template without the mapping's variables maps nothing
        return {}


class Backend:
    """Model-facing half of the server; the HTTP routes call ``prepare_chat`` / ``prepare_text`` / ``submit``."""

    def __init__(
        self,
        model_id: str,
        text: TextStack,
        loop: StepLoop,
        limits: ModelLimits,
        defaults: SamplingDefaults,
        *,
        default_max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        prep_workers: int = 2,
        reasoning_in_content: bool,
        images: ImageInputs | None = None,
        compiles_kernels: bool = False,
    ) -> None:
        self.model_id = model_id
        self.tokenizer = text.tokenizer
        self.chat_template = text.template
        self.dialect = text.dialect
        self.grammar = text.grammar  # a GrammarContext, or None without constrained decoding
        self.loop = loop  # stopped at shutdown; requests reach it through ``inbox`` only
        self.inbox = loop.inbox
        self.published = loop.published
        self.limits = limits
        self.defaults = defaults
        self.sampling_defaults = defaults.as_dict()  # /v1/models reports them; computed once
        self.effort_mapping = _effort_mapping(text.template)  # /v1/models reports it too; computed once
        self.default_max_tokens = default_max_tokens
        self.eos_token_ids = eos_token_ids
        self.reasoning_in_content = reasoning_in_content
        self.images = images  # None: a text-only model refuses image parts
        self.compiles_kernels = compiles_kernels  # a CUDA engine: its first steps compile kernels (warm-up)
        self.counters = ServiceCounters()
        self.histograms = RequestHistograms(model_id)
        self.created = int(time.time())
        self._prep = ThreadPoolExecutor(max_workers=prep_workers, thread_name_prefix="dgpp-prep")
        self._relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventRelay] = (
            weakref.WeakKeyDictionary()
        )

    # ---- prompt preparation (worker pool, off the event loop) ---------------------------------
    async def prepare_chat(self, req: Any, n: int) -> PreparedChat:
        """Render the template, tokenize, and compile the constraint (if any) in the worker pool."""
        if self.chat_template is None:
            raise APIError(
                400,
                "this model has no chat template; use /v1/completions",
                "unsupported_parameter",
                "messages",
            )
        from dgpp.text.tools import tool_specs

        tools = None if req.tool_choice == "none" else req.tools
        if (
            tools and self.dialect is None
        ):  # nothing could read a call back out of the text: refuse, never drop
            raise APIError(
                400,
                "tools are not available for this model: its family has no tool-call dialect, so "
                "no call could be parsed from its output (/v1/models: tools.available is false); "
                'send tool_choice "none" or no tools',
                "unsupported_parameter",
                "tools",
            )
        think_start = self.dialect.think_start if self.dialect is not None else "<think>"
        images = self.images
        if images is None:
            refuse_image_parts(req.messages, self.model_id)
        else:
            images.check_count(req.messages)

        def work() -> PreparedChat:
            specs = tool_specs(tools) if tools else []
            messages, processed = images.prepare(req.messages) if images else (req.messages, [])
            text = self.chat_template.render(
                messages,
                tools,
                chat_template_kwargs=req.chat_template_kwargs,
                reasoning_effort=req.reasoning_effort,
            )
            self._refuse_long_text(text, "messages")
            opens = prompt_opens_thinking(text, think_start)
            constraint = self._constraint(req, tools, opens) if specs or req.response_format else None
            matchers = self._matchers(constraint, n) if constraint is not None else None
            ids = self.tokenizer.encode(text)
            media = images.media(ids, processed) if images else None
            return PreparedChat(ids, text, tools, matchers, constraint if matchers else None, media)

        small = not tools and not req.response_format and _message_chars(req.messages) <= INLINE_PREP_CHARS
        return await self._run_prep(work, inline=small)

    def _constraint(self, req: Any, tools: list | None, opens_thinking: bool) -> dict[str, Any] | None:
        """The request's constraint as plain JSON data (``constraint_matcher``'s input), or None when this
        server has no grammar support and nothing forces one."""
        fmt = req.response_format or {}
        forced = req.tool_choice not in (None, "auto", "none")
        if self.grammar is None:
            if fmt.get("type", "text") != "text" or forced:
                param = "response_format" if fmt.get("type", "text") != "text" else "tool_choice"
                raise APIError(
                    400,
                    f"{param} needs constrained decoding, which this server does not offer",
                    "constrained_decoding_unsupported",
                    param,
                )
            return None
        return {
            "response_format": fmt or None,
            "tools": tools,
            "tool_choice": req.tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "prompt_opens_thinking": opens_thinking,
        }

    def _matchers(self, constraint: dict[str, Any], n: int) -> list[Any] | None:
        first = self.constraint_matcher(constraint)
        return (
            None if first is None else [first] + [self.constraint_matcher(constraint) for _ in range(n - 1)]
        )

    def constraint_matcher(self, constraint: dict[str, Any]) -> Any:
        """A fresh grammar matcher for ``constraint`` (``_constraint``'s output, possibly as journaled by rank 0),
        or None when it constrains nothing. The same constraint gives the same masks on every rank."""
        if self.grammar is None:
            raise GrammarError(
                "this rank has no constrained decoding (grammar context unavailable)", "response_format"
            )
        from dgpp.text.grammar import build_matcher

        return build_matcher(self.grammar, dialect=self.dialect, **constraint)

    def output_processors(
        self,
        handle: RequestHandle,
        prepared: PreparedChat | None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> list[OutputProcessor]:
        """One ``OutputProcessor`` per choice; a chat routes reasoning and tool calls, a legacy completion
        passes its text through unchanged and reports the EOS that ended it among its logprobs, as OpenAI and
        vLLM do (log-likelihood harnesses drop the generated token's entry as the last one)."""
        request = handle.request
        common: dict[str, Any] = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        if prepared is None:
            common |= {"reasoning_in_content": True, "eos_logprobs": True}
        else:
            common |= {
                "prompt": prepared.prompt_text,
                "dialect": self.dialect,
                "tools": prepared.tools,
                "reasoning_in_content": self.reasoning_in_content,
            }
        return [
            OutputProcessor(
                i,
                self.tokenizer,
                request.params,
                self.eos_token_ids,
                request_tag=request.choice_id(i) if prepared is not None else 0,
                **common,
            )
            for i in range(request.n)
        ]

    async def prepare_text(self, prompt: str) -> list[int]:
        self._refuse_long_text(prompt, "prompt")
        ids = await self._run_prep(
            lambda: self.tokenizer.encode(prompt), inline=len(prompt) <= INLINE_PREP_CHARS
        )
        if not ids:
            raise APIError(400, "prompt is empty after tokenization", "invalid_parameter", "prompt")
        return ids

    def _refuse_long_text(self, text: str, param: str) -> None:
        """400 for a prompt that cannot fit whatever it tokenizes to, decided from its length alone: a
        20 MB prompt is refused at once instead of after seconds of tokenizing (and gigabytes of offsets)."""
        at_least = self.tokenizer.min_tokens(text)
        limit = self.limits.request_limit_tokens
        if at_least >= limit:
            raise APIError(
                400,
                f"the prompt ({len(text)} characters, at least {at_least} tokens) leaves no room to "
                f"generate within {limit} tokens",
                "context_length_exceeded",
                param,
            )

    async def _run_prep(self, fn: Any, inline: bool = False) -> Any:
        """``fn()`` in the worker pool, or ``inline`` on the event loop: a short prompt's preparation (~0.1 ms)
        costs less than the hop to a worker and back, and the hop made a burst's requests reach the engine in
        lockstep only after every one of them had been read and queued (docs/benchmarks.md)."""
        try:
            if inline:
                return fn()
            return await asyncio.get_running_loop().run_in_executor(self._prep, fn)
        except GrammarError as e:
            raise APIError(400, e.message, "invalid_grammar", e.param) from None
        except TextError as e:
            raise APIError(400, e.message, "invalid_parameter", e.param) from None

    # ---- submission ---------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request`` (``serve/generation.generation_request`` built it) as it is; 503 when the queue is
        full or the engine failed."""
        handle = RequestHandle(request, self.inbox)
        try:
            self.inbox.submit(request, self._relay(asyncio.get_running_loop()).sink(handle.queue))
            submitted()  # an idle engine's admission hold no longer waits for this request (``announced``)
        except QueueFull as e:
            raise overloaded(f"server overloaded: {e}") from None
        except StepLoopFailed as e:
            raise APIError(503, f"engine failed: {e}", "engine_failure") from None
        return handle

    @property
    def queue_limit(self) -> int:
        """``engine.queue_limit``: requests waiting beyond it are refused (503, retryable)."""
        return self.inbox.queue_limit

    def _relay(self, loop: asyncio.AbstractEventLoop) -> EventRelay:
        """The event relay of ``loop`` (one per serving loop; tests may serve from several loops in turn)."""
        relay = self._relays.get(loop)
        if relay is None:
            relay = self._relays[loop] = EventRelay(loop, on_retired=self.histograms.retired)
        return relay

    def shutdown(self) -> None:
        self.loop.stop()
        self._prep.shutdown(wait=False, cancel_futures=True)
