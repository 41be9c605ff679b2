"""The model-facing half of the server (``Backend``): prompt preparation off the event loop, submission, and
per-request events.

``Backend`` is what the HTTP routes talk to. It owns the tokenizer and chat template, knows the
served model's limits, and turns one HTTP request into ``n`` scheduler sequences whose events arrive on
an asyncio queue (the step loop thread posts them with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import secrets
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dgpp.media.prompt import PromptMedia
from dgpp.sample.params import SamplingDefaults, SamplingParams
from dgpp.sample.sampler import ChoiceSampler
from dgpp.sched.request import RetireReason, SeqEvent, Sequence
from dgpp.sched.scheduler import QueueFull
from dgpp.sched.step_loop import StepLoop, StepLoopFailed
from dgpp.serve.arrivals import submitted
from dgpp.serve.errors import APIError, overloaded
from dgpp.serve.event_relay import EventRelay
from dgpp.serve.generation import fit_to_prompt
from dgpp.serve.images import ImageInputs, refuse_image_parts
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
        self.tool_calls_out += sum(len(o.text.tool_calls) for o in outputs)


@dataclass
class ModelLimits:
    vocab_size: int
    max_position: int
    kv_pool_tokens: int

    @property
    def request_limit_tokens(self) -> int:
        return min(self.max_position, self.kv_pool_tokens)


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
    """One HTTP request's sequences and the queue their events arrive on: ``(choice_index, SeqEvent)``."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    backend: Backend | None = None
    done: set[int] = field(default_factory=set)  # choices the scheduler has retired
    cancelled: set[int] = field(default_factory=set)  # choices we asked the scheduler to stop

    def cancel(self, choice: int | None = None, reason: RetireReason = RetireReason.CANCELLED) -> None:
        """Stop one choice (a stop string matched) or, with ``choice=None``, every unfinished choice."""
        assert self.backend is not None
        for s in self.seqs:
            i = s.choice_index
            if (choice is None or i == choice) and i not in self.done and i not in self.cancelled:
                self.cancelled.add(i)
                self.backend.loop.cancel(s.request_id, reason)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.seqs)

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


class Backend:
    """Model-facing half of the server; the HTTP routes call ``prepare_chat`` / ``prepare_text`` / ``submit``."""

    def __init__(
        self,
        model_id: str,
        tokenizer: Any,
        chat_template: Any,
        loop: StepLoop,
        limits: ModelLimits,
        defaults: SamplingDefaults,
        *,
        default_max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        prep_workers: int = 2,
        dialect: Any = None,
        grammar: Any = None,
        reasoning_in_content: bool,
        images: ImageInputs | None = None,
    ) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.loop = loop
        self.limits = limits
        self.defaults = defaults
        self.default_max_tokens = default_max_tokens
        self.eos_token_ids = eos_token_ids
        self.dialect = dialect
        self.grammar = grammar  # a dgpp.text.grammar.GrammarContext, or None without constrained decoding
        self.reasoning_in_content = reasoning_in_content
        self.images = images  # None: a text-only model refuses image parts
        self.counters = ServiceCounters()
        self.created = 0
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
        from dgpp.text.reasoning import ReasoningSplitter
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
        think = (
            (self.dialect.think_start, self.dialect.think_end)
            if self.dialect is not None
            else ("<think>", "</think>")
        )
        images = self.images
        if images is None:
            refuse_image_parts(req.messages, self.model_id)
        else:
            images.check_count(req.messages)

        def work() -> PreparedChat:
            specs = tool_specs(tools)
            messages, processed = images.prepare(req.messages) if images else (req.messages, [])
            text = self.chat_template.render(
                messages,
                tools,
                chat_template_kwargs=req.chat_template_kwargs,
                reasoning_effort=req.reasoning_effort,
            )
            self._refuse_long_text(text, "messages")
            opens = ReasoningSplitter.prompt_opens_thinking(text, *think)
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

    def text_outputs(
        self,
        handle: RequestHandle,
        prepared: PreparedChat | None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> list[Any]:
        """One ``ServedChoice`` per choice; a chat routes reasoning and tool calls, a legacy completion
        passes its text through unchanged."""
        from dgpp.serve.choice_output import ServedChoice
        from dgpp.text.output import ChoiceOutput

        out = []
        special = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "eos_is_text": handle.params.ignore_eos,
        }
        for i in range(len(handle.seqs)):
            if prepared is None:
                text = ChoiceOutput(
                    self.tokenizer, stop=handle.params.stop, reasoning_in_content=True, **special
                )
            else:
                text = ChoiceOutput(
                    self.tokenizer,
                    prompt=prepared.prompt_text,
                    dialect=self.dialect,
                    tools=prepared.tools,
                    stop=handle.params.stop,
                    reasoning_in_content=self.reasoning_in_content,
                    request_tag=f"{handle.request_id}/{i}",
                    **special,
                )
            # a legacy completion reports the EOS that ended it among its logprobs, as OpenAI and vLLM do
            # (log-likelihood harnesses drop the generated token's entry as the last one)
            out.append(
                ServedChoice(
                    i, text, self.tokenizer, handle.params, self.eos_token_ids, eos_logprobs=prepared is None
                )
            )
        return out

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
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        use_prefix_cache: bool = True,
        kind: str = "chatcmpl",
        matchers: list[Any] | None = None,
        max_tokens_given: bool = True,
        constraint: dict[str, Any] | None = None,
        samplers: list[ChoiceSampler] | None = None,
        media: PromptMedia | None = None,
    ) -> RequestHandle:
        """Check the budget, make the ``n`` sequences, queue them; 400/503 on failure.

        The limit is fitted to the prompt by ``serve/generation.fit_to_prompt`` (``max_tokens_given``: the
        request named it).
        ``samplers`` (one per choice) replace the request's own, e.g. a ``ForcedSampler`` scoring a prompt."""
        if not prompt_ids:  # a model step needs at least one token: an empty prompt would fail the step loop
            param = "messages" if kind == "chatcmpl" else "prompt"
            raise APIError(
                400, "the prompt is empty after rendering and tokenization", "invalid_parameter", param
            )
        top = max(prompt_ids)
        if (
            top >= self.limits.vocab_size
        ):  # a tokenizer with more (added) tokens than the model's embedding rows
            param = "messages" if kind == "chatcmpl" else "prompt"
            raise APIError(
                400,
                f"the prompt holds token id {top} ({self.tokenizer.decode([top])!r}), past the "
                f"model's vocabulary of {self.limits.vocab_size}",
                "invalid_parameter",
                param,
            )
        params = fit_to_prompt(
            params,
            len(prompt_ids),
            max_position=self.limits.max_position,
            kv_pool_tokens=self.limits.kv_pool_tokens,
            named=max_tokens_given,
            prompt_param="messages" if kind == "chatcmpl" else "prompt",
            constrained=bool(matchers),
        )
        handle = RequestHandle(f"{kind}-{secrets.token_hex(8)}", prompt_ids, params, backend=self)
        sink = self._relay(asyncio.get_running_loop()).sink(handle.queue)
        for i in range(n):
            # n choices of one seeded request differ: each draws from (seed, choice index)
            m = matchers[i] if matchers else None
            sampler = (
                samplers[i]
                if samplers
                else ChoiceSampler(
                    params,
                    self.limits.vocab_size,
                    prompt_ids,
                    choice_index=i,
                    mask_fn=m.mask if m else None,
                    accept_fn=m.accept if m else None,
                )
            )
            handle.seqs.append(
                Sequence(
                    f"{handle.request_id}/{i}",
                    i,
                    prompt_ids,
                    params,
                    sampler,
                    sink,
                    use_prefix_cache=use_prefix_cache,
                    leader=handle.seqs[0] if i else None,
                    constraint=constraint if m else None,
                    media=media,
                )
            )
        try:
            self.loop.submit(handle.seqs)
            submitted()  # an idle engine's admission hold no longer waits for this request (serve/arrivals.py)
        except QueueFull as e:
            raise overloaded(f"server overloaded: {e}") from None
        except StepLoopFailed as e:
            raise APIError(503, f"engine failed: {e}", "engine_failure") from None
        return handle

    @property
    def queue_limit(self) -> int:
        """``engine.queue_limit``: requests waiting beyond it are refused (503, retryable)."""
        return self.loop.published.config.queue_limit

    def _relay(self, loop: asyncio.AbstractEventLoop) -> EventRelay:
        """The event relay of ``loop`` (one per serving loop; tests may serve from several loops in turn)."""
        relay = self._relays.get(loop)
        if relay is None:
            relay = self._relays[loop] = EventRelay(loop)
        return relay

    def shutdown(self) -> None:
        self.loop.stop()
        self._prep.shutdown(wait=False, cancel_futures=True)
