"""Chat data for distilling a draft model: a model's own greedy answers to varied questions,
as JSONL conversations (`{"messages": [user, assistant]}`) that `llmsplit train` reads with
data.format="chat". A draft is worth what it agrees with its model on what that model says,
so it learns from the model's answers (and, with train.teacher, from its logits on them).

`python -m benchmarks.draft_data --model SmolLM2-135M-Instruct.Q4_1.gguf --out chat.jsonl [--n 192]`

The questions are templates over topics, none of them the prompts benchmarks/speculative.py
measures with (its open set), so the draft is measured on questions it never saw.
"""

from __future__ import annotations

import argparse
import json
import time

TOPICS = ["the moon", "volcanoes", "bread", "bicycles", "honeybees", "the ocean", "trains", "chess", "rain",
          "libraries", "mountains", "coffee", "electricity", "gardens", "whales", "music", "bridges", "winter",
          "forests", "the internet", "clocks", "deserts", "birds", "cities", "friendship", "rivers", "stars",
          "cooking", "football", "paper", "glass", "islands"]
TEMPLATES = ["Explain {} to a ten-year-old.", "Give me three facts about {}.", "Write a short poem about {}.",
             "What is the history of {}?", "Write a short story about {}.", "Why do people like {}?"]


def questions(n: int) -> list[str]:
    out = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    return out[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=len(TOPICS) * len(TEMPLATES))
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    import llmsplit
    from llmsplit.infer.chat import chat_prompt
    from llmsplit.infer.engine import SamplingParams

    m = llmsplit.load(a.model, max_batch=a.batch, max_context=512)
    asked = questions(a.n)
    start, tokens = time.perf_counter(), 0
    with open(a.out, "w") as f:
        for i in range(0, len(asked), a.batch):
            chunk = asked[i:i + a.batch]
            seqs = [m.engine.new_sequence(chat_prompt([{"role": "user", "content": q}], m.tokenizer)[0],
                                          SamplingParams(a.max_new_tokens)) for q in chunk]
            m.engine.generate(seqs)
            for q, seq in zip(chunk, seqs):
                tokens += len(seq.tokens)
                f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                                 {"role": "assistant", "content": seq.text}]}) + "\n")
            print(f"{i + len(chunk)}/{len(asked)} answers, {tokens} tokens, "
                  f"{tokens / (time.perf_counter() - start):.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
