"""tool_choice "auto": the calls a model writes in its template's format (Hermes <tool_call>,
Llama 3.1+ JSON, Mistral [TOOL_CALLS]) become OpenAI's tool_calls, read the same whether the
reply comes whole or streamed in any pieces; the parser is picked from the chat template
(`serve --tool-call-parser auto`). Literal model outputs and template strings: real Llama 3.1
and Mistral templates are not on this machine."""

import random
from types import SimpleNamespace

import pytest

from llmsplit.errors import ConfigError
from llmsplit.infer.choices import TOOL_CALL_PARSERS
from llmsplit.infer.config import InferConfig
from llmsplit.infer.serve.replies import Reply
from llmsplit.infer.serve.tool_calls import PARSERS, CallScanner, pick_parser

GET_TIME = ("get_time", '{"zone": "utc"}')
NOOP = ("noop", "{}")

# (parser, the model's reply, the content, the calls as (name, arguments)).
OUTPUTS = [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>', None, [GET_TIME]),
    ("hermes", 'Checking. <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',
     "Checking.", [GET_TIME]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>\n<tool_call>{"name": '
               '"noop", "arguments": {}}</tool_call>\nDone.', "Done.", [GET_TIME, NOOP]),
    ("hermes", 'A <tool_call>{"name": "noop", "arguments": {}}</tool_call> B', "A B", [NOOP]),
    ("hermes", '<tool_call>{"name": "echo", "arguments": {"s": "}\\"{ ]"}}</tool_call>', None,
     [("echo", '{"s": "}\\"{ ]"}')]),  # brackets and an escaped quote inside a string
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}', None, [GET_TIME]),  # cut by a stop
    ("hermes", "<tool_call>{oops}</tool_call>", "<tool_call>{oops}</tool_call>", []),
    ("hermes", 'ok <tool_call>{oops}</tool_call> <tool_call>{"name": "noop", "arguments": {}}</tool_call>',
     "ok <tool_call>{oops}</tool_call>", [NOOP]),  # a malformed call stays content; the good one is a call
    ("hermes", "no calls here, just a < sign and <tool", "no calls here, just a < sign and <tool", []),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "utc"}}', None, [GET_TIME]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}', None, [GET_TIME]),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "utc"}}; {"name": "noop", "parameters": {}}',
     None, [GET_TIME, NOOP]),
    ("llama3_json", 'Let me see. <|python_tag|>{"name": "noop", "parameters": {}}', "Let me see.", [NOOP]),
    ("llama3_json", '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),  # JSON, no call announced
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "utc"}', '{"name": "get_time", "parameters": '
                    '{"zone": "utc"}', []),  # never closed
    ("llama3_json", 'Use {"name": "noop", "parameters": {}} like this', 'Use {"name": "noop", "parameters": {}} '
                    'like this', []),  # JSON after content, without <|python_tag|>: an answer, not a call
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "noop", '
                '"arguments": {}}]', None, [GET_TIME, NOOP]),
    ("mistral", '[{"name": "get_time", "arguments": {"zone": "utc"}}]', None, [GET_TIME]),  # the marker decoded away
    ("mistral", 'See [1]. [TOOL_CALLS][{"name": "noop", "arguments": {}}]', "See [1].", [NOOP]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": ]',
     '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": ]', []),
    ("mistral", "[1, 2, 3] are the numbers", "[1, 2, 3] are the numbers", []),
]


def _read(parser: str, text: str, cuts=()) -> tuple[str | None, list[tuple[str, str]]]:
    """The reply's content and calls, fed in the pieces `cuts` makes (none: whole)."""
    scanner, content, calls, start = CallScanner(PARSERS[parser]), "", [], 0
    for end in [*sorted(cuts), len(text)]:
        piece_content, piece_calls = scanner.feed(text[start:end])
        content, calls, start = content + piece_content, calls + piece_calls, end
    last_content, last_calls = scanner.feed("", final=True)
    content, calls = content + last_content, calls + last_calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return (content or None) if calls else content, [(c["function"]["name"], c["function"]["arguments"])
                                                      for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", OUTPUTS)
def test_calls_are_read_alike_whole_and_in_any_stream_pieces(parser, text, content, calls):
    assert _read(parser, text) == (content, calls)
    for cut in range(1, len(text)):  # every single boundary, inside each marker among them
        assert _read(parser, text, [cut]) == (content, calls), cut
    assert _read(parser, text, range(1, len(text))) == (content, calls)  # one character a piece
    rng = random.Random(0)
    for _ in range(50):
        cuts = rng.sample(range(1, len(text)), rng.randint(2, min(8, len(text) - 1)))
        assert _read(parser, text, cuts) == (content, calls), cuts


def test_text_that_may_begin_a_call_is_held_until_decided():
    scanner = CallScanner(PARSERS["hermes"])
    assert scanner.feed("Checking. <tool") == ("Checking.", [])  # the space too: dropped if a call follows
    assert scanner.feed('_call>{"name": "noop", "arguments"') == ("", [])
    content, calls = scanner.feed(': {}}</tool_call>')
    assert content == "" and [c["function"]["name"] for c in calls] == ["noop"]
    # After a call, whitespace is kept where content came before: it joins "Checking." and "Then more."
    assert scanner.feed(" Then more.") == (" Then more.", [])
    assert scanner.feed("", final=True) == ("", [])
    plain = CallScanner(PARSERS["hermes"])
    assert plain.feed("a <b>") == ("a <b>", []) and plain.feed(" c ") == (" c", [])
    assert plain.feed("", final=True) == (" ", [])  # no call: the content is the text unchanged
    mistral = CallScanner(PARSERS["mistral"])
    assert mistral.feed("[TOOL_") == ("", []) and mistral.feed('CALLS] [{"name": "noop"') == ("", [])
    assert [c["function"]["name"] for c in mistral.feed(', "arguments": {}}]')[1]] == ["noop"]


@pytest.mark.parametrize("template,picked", [
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n{\"name\": <function-name>, \"arguments\": "
     "<args-json-object>}\n</tool_call>", "hermes"),  # Qwen2.5's, in short
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% endif %}", "mistral"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}", "mistral"),
    ("{% if tools %}{{ tools }}{% endif %}{% if m.role == 'ipython' %}<|start_header_id|>ipython{% endif %}",
     "llama3_json"),
    ("{{ tools }} Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name "
     "and its value}.", "llama3_json"),
    ("{% if tools %}{{ tools }}{% endif %}{{ m.content }}<|python_tag|>", "llama3_json"),
    ("{% for t in tools %}{{ t.function.name }}{% endfor %}{{ messages[0].content }}", "hermes"),  # no sign
])
def test_auto_picks_the_parser_from_the_chat_template(template, picked):
    assert pick_parser("auto", template).name == picked
    assert pick_parser("mistral", template).name == "mistral"  # a name given wins over the template
    assert pick_parser("none", template) is None


def test_the_parser_choices_are_one_list_in_infer_config():
    from llmsplit.cli import COMMANDS
    from llmsplit.cli_args import build_parser

    assert set(TOOL_CALL_PARSERS) == {"auto", "none", *PARSERS}
    assert InferConfig().tool_call_parser == "auto"
    with pytest.raises(ConfigError, match="--tool-call-parser 'xml' is not one of: auto, hermes"):
        InferConfig(tool_call_parser="xml")
    parser = build_parser(COMMANDS)
    assert parser.parse_args(["serve", "--model", "m", "--tool-call-parser", "mistral"]).tool_call_parser == "mistral"
    assert parser.parse_args(["serve", "--model", "m"]).tool_call_parser == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--tool-call-parser", "xml"])


def _seq(text: str, finish: str = "stop"):
    return SimpleNamespace(id=0, text=text, finish_reason=finish, prompt=[1], tokens=[2], logprobs=[])


@pytest.mark.parametrize("parser,text,content,calls", OUTPUTS)
def test_a_reply_streams_calls_as_deltas_and_ends_as_the_whole_message(parser, text, content, calls):
    seq = _seq(text)
    whole, finish = Reply("m", True, [seq], tools=PARSERS[parser]).message(seq)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    assert (whole["content"], got, finish) == (content, calls, "tool_calls" if calls else "stop")
    reply = Reply("m", True, [seq], tools=PARSERS[parser])
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    chunks = [reply.chunk(0, text=piece, tokens=1) for piece in pieces] + [reply.last_chunk(0, seq)]
    deltas = [c["choices"][0] for c in chunks if c is not None]
    assert deltas[-1]["finish_reason"] == finish and all(d["finish_reason"] is None for d in deltas[:-1])
    streamed = "".join(d["delta"].get("content", "") for d in deltas)
    assert streamed == (content or "")
    tool_deltas = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert [t["index"] for t in tool_deltas] == list(range(len(calls)))
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in tool_deltas] == calls


def test_a_reply_cut_by_max_tokens_keeps_its_finish_reason_and_none_leaves_calls_as_text():
    text = '<tool_call>{"name": "noop", "arguments": {}}</tool_call> and then'
    seq = _seq(text, finish="length")
    message, finish = Reply("m", True, [seq], tools=PARSERS["hermes"]).message(seq)
    assert finish == "length" and message["content"] == "and then" and len(message["tool_calls"]) == 1
    plain, finish = Reply("m", True, [_seq(text)], tools=None).message(_seq(text))  # --tool-call-parser none
    assert plain == {"role": "assistant", "content": text} and finish == "stop"


MISTRAL_TEMPLATE = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
                    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}")


def test_a_served_chat_answers_and_streams_the_calls_its_template_asks_for(tmp_path):
    """Through the app: the parser picked from the model's template (mistral here), the reply
    read whole and streamed (one tool_calls delta, finish_reason tool_calls), `none` as text.
    The engine is scripted: a random model would write no call."""
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    pytest.importorskip("fastapi")
    import json

    from starlette.testclient import TestClient

    import llmsplit
    from hf_models import make_hf_folder
    from llmsplit.infer.serve.server import Server

    written = 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "utc"}}]'

    def submit(ids, params, sink, stream=False, adapter=0, n=1):
        seq = SimpleNamespace(id=0, text=written, finish_reason="stop", prompt=ids[0], tokens=[5] * 9, logprobs=[])
        for i in range(0, len(written) if stream else 0, 4):  # pieces that cut the marker
            sink(("text", 0, written[i:i + 4], 1 + i // 4))
        sink(("finish", 0, seq))
        return SimpleNamespace(seqs=[seq])

    model = llmsplit.load(make_hf_folder(tmp_path / "llama", num_hidden_layers=1), max_batch=1, max_context=256)
    model.tokenizer.chat_template = MISTRAL_TEMPLATE
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": [{"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]}
    try:
        answers = {}
        for choice in ("auto", "none"):
            server = Server(model, "llama", tool_call_parser=choice)
            server.scheduler.submit = submit
            with TestClient(server.app) as c:
                whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
                events = c.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
            deltas = [json.loads(e[6:])["choices"][0] for e in events if e.startswith("data: {")]
            answers[choice] = whole, deltas, server.tool_parser
        model.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        with TestClient(Server(model, "llama").app) as c:  # a template that renders no tools: the model can't call
            refused = c.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and "does not render tools" in refused.json()["error"]["message"]
    finally:
        model.close()
    whole, deltas, parser = answers["auto"]
    assert parser.name == "mistral" and whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Sure."
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Sure."
    (streamed,) = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    plain, deltas, parser = answers["none"]
    assert parser is None and plain["finish_reason"] == "stop"
    assert plain["message"] == {"role": "assistant", "content": written}
    assert "".join(d["delta"].get("content") or "" for d in deltas) == written
