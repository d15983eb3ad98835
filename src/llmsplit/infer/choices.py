"""The values the inference flags take, in a module that imports nothing: the command line's
parsers list them as `choices` without loading torch (infer/config.py, which checks them in
`InferConfig`, imports torch through the launcher)."""

# --compile: "auto" compiles the decode step in a background process once per model shape and
# machine, then at every later load from the caches (compile_cache.py); "now" at this load; "off" never.
COMPILE = ("auto", "now", "off")
KV_DTYPES = ("int8", "bfloat16")  # --kv-dtype (runner/kv_cache.py stores them); default: the compute dtype
# --speculative: the proposers engine/speculative.py has besides a draft model's path
SPECULATIVE = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # --speculative-tokens: proposals a step may verify per sequence
POOLING = ("last", "mean")  # --pooling: how an embedding pools a text's final hidden states
# --tool-call-parser: how serve reads tool calls out of a reply (serve/tool_calls.py has one
# parser per format); auto picks by the chat template's text, none leaves calls as content.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")
