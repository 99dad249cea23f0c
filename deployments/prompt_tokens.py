"""A request's and a feedback item's token counts as the engine and the trainer will see them (the model's own
tokenizer and chat template): the router's placement estimate and the per-node feedback sizes both start here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class PromptCounter:
    """The prompt's token count as the engine will see it (the model's own tokenizer and chat template)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)

    def count(self, body: dict[str, Any]) -> int:
        try:
            if "messages" in body:
                ids = self.tok.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
                # transformers 5 returns a BatchEncoding (a Mapping, not a dict): its length is its key count.
                return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)
            prompt = body.get("prompt")
            prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
            total = 0
            for p in prompts:
                total += len(p) if isinstance(p, list) else len(self.tok(p).input_ids) if isinstance(p, str) else 0
            return max(1, total)
        except Exception:  # a malformed body: the replica rejects it, the count does not matter
            return 1

    def feedback_tokens(self, item: Any, max_length: int) -> int:
        """ℓ of a feedback item's training task: the tokens of one pass over it, each sequence cut at
        ``max_length`` as the trainer cuts it: context + completion (SFT), context + chosen and context +
        rejected (DPO). The context is rendered as a request's is; a malformed item counts 1 (the store
        rejects it)."""
        try:
            if not isinstance(item, dict):
                return 1
            messages = item.get("messages")
            answers = [item[k] for k in ("completion", "chosen", "rejected") if isinstance(item.get(k), str)]
            if (
                isinstance(messages, list)
                and messages
                and not answers
                and isinstance(messages[-1], dict)
                and messages[-1].get("role") == "assistant"
            ):  # OpenAI's fine-tuning shape
                answers, messages = [str(messages[-1].get("content") or "")], messages[:-1]
            body = {"messages": messages} if isinstance(messages, list) else {"prompt": str(item.get("prompt") or "")}
            context = self.count(body)
            if not answers:
                return min(max_length, context)
            return sum(min(max_length, context + len(self.tok(a).input_ids)) for a in answers)
        except Exception:
            return 1
