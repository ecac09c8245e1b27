"""With the plugin loaded, sglang's own API answers exactly as sglang does.

The oracle is the same CPU server with the plugin disabled (`disabled_server`: `SGLANG_PLUGINS`
names only the CPU stand-in's own plugin). Every case goes to it and to two servers with the
plugin loaded, all with the same flags (`--enable-return-hidden-states --disable-radix-cache`):
one with no plugin feature on (`hs_noradix_server`) and one with `--toploc-verification` (and a
calibration file, test_toploc_calibration.py), whose fingerprints (asked for by that flag) are the
only field it may add. A case that sets plugin
fields is sent to the oracle without them, and only the fields they ask for may differ. Greedy
decoding and no radix cache keep both sides deterministic; the comparison is exact.
"""

from __future__ import annotations

import pytest

from differential import DIFFERENTIAL_TOPLOC, Case, call, compare
from e2e_servers import Server, server_fixture
from hidden_states_fixtures import HS_NORADIX, stop_token

FLAGS = HS_NORADIX.args  # the flags of all three servers
FINGERPRINTS = ("toploc_verification_fingerprints",)

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0}
CHAT = [{"role": "user", "content": "Name three colours."}]
SHORT_CHAT = [{"role": "user", "content": "Say hi."}]
IDS = ("return_input_ids", "return_output_ids")
ROWS = ("hidden_states_format", "hidden_states_scope")


def _generate(name: str, **body) -> Case:
    return Case(name, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, **GREEDY}, **body})


def _completion(name: str, plugin_fields: tuple = (), replaced: tuple = (), **body) -> Case:
    return Case(name, "/v1/completions", {"model": "default", "prompt": PROMPT, "max_tokens": 4, **GREEDY, **body},
                plugin_fields, replaced)


def _chat(name: str, plugin_fields: tuple = (), replaced: tuple = (), **body) -> Case:
    return Case(name, "/v1/chat/completions",
                {"model": "default", "messages": CHAT, "max_tokens": 5, **GREEDY, **body}, plugin_fields, replaced)


UPSTREAM_CASES = [
    Case("models", "/v1/models"),
    Case("model info", "/get_model_info"),
    _generate("generate"),
    _generate("generate stream", stream=True),
    Case("generate batch", "/generate", {"text": [PROMPT, "One, two,", "Water boils at"],
                                         "sampling_params": {"max_new_tokens": 6, **GREEDY}}),
    Case("generate ids batch", "/generate", {"input_ids": [[504, 3575, 282], [1205, 28, 827]],
                                             "sampling_params": [{"max_new_tokens": 4, **GREEDY},
                                                                 {"max_new_tokens": 7, **GREEDY}]}),
    Case("generate n=2", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "n": 2, **GREEDY}}),
    _generate("generate logprobs", return_logprob=True, top_logprobs_num=3, logprob_start_len=0),
    _generate("generate logprobs stream", return_logprob=True, top_logprobs_num=2, stream=True),
    _generate("generate hidden states", return_hidden_states=True),
    _generate("generate hidden states last", return_hidden_states="last"),
    _generate("generate hidden states stream", return_hidden_states=True, stream=True),
    Case("generate ignore eos", "/generate", {"text": "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
                                              "sampling_params": {"max_new_tokens": 24, "ignore_eos": True,
                                                                  **GREEDY}}),
    _completion("completion"),
    _completion("completion stream", stream=True),
    _completion("completion batch", prompt=[PROMPT, "Water boils at"]),
    _completion("completion n=2", n=2),
    _completion("completion n=2 stream", n=2, stream=True),
    _completion("completion logprobs", logprobs=3),
    _completion("completion logprobs stream", logprobs=2, stream=True),
    _completion("completion echo", echo=True, max_tokens=4),
    _completion("completion hidden states", return_hidden_states=True),
    _completion("completion hidden states last", return_hidden_states="last"),
    _completion("completion hidden states stream", return_hidden_states=True, stream=True),
    _completion("completion hidden states n=2 stream", return_hidden_states=True, n=2, stream=True),
    _completion("completion usage stream", stream=True, stream_options={"include_usage": True}),
    _chat("chat"),
    _chat("chat stream", stream=True),
    _chat("chat n=2", n=2),
    _chat("chat logprobs", logprobs=True, top_logprobs=3),
    # no top_logprobs when streamed: sglang gives every token of a chunk the first token's top
    # log-probs (serving_chat._process_logprobs_tokens, index 0), so they depend on chunking
    _chat("chat logprobs stream", logprobs=True, stream=True),
    _chat("chat ignore eos", messages=SHORT_CHAT, max_tokens=24, ignore_eos=True),
    _chat("chat hidden states", return_hidden_states=True),
    _chat("chat hidden states last", return_hidden_states="last"),
    _chat("chat hidden states stream", return_hidden_states=True, stream=True),
    _chat("chat hidden states n=2 stream", return_hidden_states=True, n=2, stream=True),
    _chat("chat usage stream", stream=True, stream_options={"include_usage": True}),
]


def stop_cases(prompt_stop: int, chat_stop: int, tokenizer) -> list[Case]:
    """Requests that end on a stop string or token before their length: `prompt_stop` and
    `chat_stop` are tokens the served model's greedy answers to PROMPT and SHORT_CHAT reach
    (`stops`; the random-weight model never reaches its EOS, so a stop token stands in for it)."""
    text = tokenizer.decode([prompt_stop])
    chat = {"messages": SHORT_CHAT, "max_tokens": 24}
    return [
        Case("generate stop string", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16,
                                                                                       "stop": [text], **GREEDY}}),
        Case("generate stop token", "/generate", {"text": PROMPT, "sampling_params": {
            "max_new_tokens": 16, "stop_token_ids": [prompt_stop], **GREEDY}}),
        _completion("completion stop", stop=[text], max_tokens=16),
        _chat("chat stop token", stop_token_ids=[chat_stop], **chat),
        _chat("chat stop token stream", stop_token_ids=[chat_stop], stream=True, **chat),
        _chat("chat stop", stop=[tokenizer.decode([chat_stop])], **chat),
    ]


# Requests that set plugin fields: everything but what those fields ask for stays upstream's.
PLUGIN_CASES = [
    Case("generate ids", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, **GREEDY},
                                       "return_input_ids": True, "return_output_ids": True}, IDS),
    Case("generate rows", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, **GREEDY},
                                        "return_hidden_states": True, "hidden_states_format": "base64",
                                        "hidden_states_scope": "response"}, ROWS, ("hidden_states",)),
    _completion("completion ids stream", IDS, stream=True, return_input_ids=True, return_output_ids=True),
    _completion("completion rows", ROWS, ("hidden_states",), return_hidden_states=True,
                hidden_states_format="base64", hidden_states_scope="all"),
    _chat("chat rows stream", ROWS, ("hidden_states",), stream=True, return_hidden_states="last",
          hidden_states_format="list", hidden_states_scope="response"),
    _chat("chat ids n=2", IDS, n=2, return_input_ids=True, return_output_ids=True),
]


differential_toploc_server = server_fixture(DIFFERENTIAL_TOPLOC, scope="module")


@pytest.fixture(scope="module")
def servers(disabled_server, hs_noradix_server, differential_toploc_server) -> dict[str, Server]:
    return {"oracle": disabled_server, "plugin": hs_noradix_server, "toploc": differential_toploc_server}


def _differences(servers: dict[str, Server], cases: list[Case]) -> list[str]:
    plugin_servers = {"plugin": (servers["plugin"].url, ()), "toploc": (servers["toploc"].url, FINGERPRINTS)}
    return [found for case in cases for found in compare(case, servers["oracle"].url, plugin_servers)]


def test_oracle_runs_without_the_plugin(servers) -> None:
    """The oracle really is sglang alone: it knows no plugin flag, and it refuses a plugin field."""
    import requests

    info = requests.get(servers["oracle"].url + "/get_server_info", timeout=60).json()
    assert "toploc_verification" not in info and "drafter_cotrain" not in info, sorted(info)[:5]
    mine = requests.get(servers["toploc"].url + "/get_server_info", timeout=60).json()
    assert mine["toploc_verification"] is True


@pytest.fixture(scope="module")
def stops(servers, tokenizer) -> list[Case]:
    """`stop_cases` with the stop tokens of the served model, each checked to end its request."""
    url = servers["plugin"].url
    chat_ids = tokenizer.apply_chat_template(SHORT_CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    cases = stop_cases(stop_token(url, PROMPT, 16), stop_token(url, list(chat_ids), 24), tokenizer)
    for case in cases:
        if not case.stream:
            answer = call(url, case, case.body)
            finish = answer["meta_info"]["finish_reason"]["type"] if "meta_info" in answer else \
                answer["choices"][0]["finish_reason"]
            assert finish == "stop", (case.name, answer)
    return cases


def test_requests_with_only_upstream_fields_get_upstream_answers(servers, stops: list[Case]) -> None:
    """/generate, completions and chat (streamed and not, batches, n > 1, log-probs, hidden states
    true and "last", stop strings and tokens, ignore_eos) answer as sglang alone does."""
    differences = _differences(servers, UPSTREAM_CASES + stops)
    assert not differences, "\n".join(differences)


def test_plugin_fields_change_only_what_they_ask_for(servers) -> None:
    differences = _differences(servers, PLUGIN_CASES)
    assert not differences, "\n".join(differences)


def test_server_info_differs_only_by_plugin_flags(servers) -> None:
    """/get_server_info: the plugin adds its own flags (the fields of its ServerArgs subclass) and
    nothing else."""
    import dataclasses

    import requests

    from differential import VOLATILE_KEYS, first_difference, strip
    from sglang_rl.server_args import RLServerArgs

    # sglang's own class, which RLServerArgs extends: once a plugin has loaded in this process (an
    # Engine test), sglang.srt.server_args.ServerArgs names the subclass
    upstream = RLServerArgs.__bases__[0]
    assert (upstream.__module__, upstream.__name__) == ("sglang.srt.server_args", "ServerArgs"), upstream
    plugin_keys = {f.name for f in dataclasses.fields(RLServerArgs)} - {f.name for f in dataclasses.fields(upstream)}
    assert plugin_keys, "RLServerArgs adds no field to sglang's ServerArgs"
    oracle = requests.get(servers["oracle"].url + "/get_server_info", timeout=60).json()
    for name in ("plugin", "toploc"):
        info = requests.get(servers[name].url + "/get_server_info", timeout=60).json()
        added = set(info) - set(oracle)
        assert added == plugin_keys, (name, sorted(added ^ plugin_keys))
        difference = first_difference(strip(info, VOLATILE_KEYS | plugin_keys), strip(oracle, VOLATILE_KEYS))
        assert difference is None, (name, difference)
