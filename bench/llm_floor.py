"""The floor of the language-model benchmark (bench/llm.py): llama.cpp in this process through
llama-cpp-python, decoding the same chat as the servers are sent. What no server can beat; it
stands apart from the servers because it has no process, no port and no HTTP.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

from bench.llm_workload import CONTEXT, CORES, DECODE_TOKENS, chat, decode_turn


class Floor:
    """llama.cpp through llama-cpp-python in this process: one sequence, the same rendered chat
    prompt, greedy decoding of the same number of new tokens; no server, no HTTP."""

    name = "in process (floor)"

    def __init__(self, model: Path) -> None:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        t0 = time.perf_counter()
        self.llm = Llama(str(model), n_ctx=CONTEXT, n_threads=CORES, n_threads_batch=CORES, verbose=False)
        self.load_s = time.perf_counter() - t0
        mdl = self.llm._model
        self.vocab = mdl.vocab
        self.is_eog = llama_cpp.llama_vocab_is_eog
        self.fmt = Jinja2ChatFormatter(
            template=self.llm.metadata["tokenizer.chat_template"],
            eos_token=mdl.token_get_text(self.llm.token_eos()),
            bos_token=mdl.token_get_text(self.llm.token_bos()),
        )

    def decode(self, turn: int) -> tuple[float, int]:
        """Tokens/s after the first token, and the tokens made."""
        prompt = self.fmt(messages=cast(Any, chat(decode_turn(turn)))).prompt
        ids = self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
        self.llm.reset()  # a whole prefill each time, as for a new request to a server
        first = last = 0.0
        count = 0
        for tok in self.llm.generate(ids, temp=0.0, top_k=1):
            if self.is_eog(self.vocab, tok):
                break
            last = time.perf_counter()
            first = first or last
            count += 1
            if count >= DECODE_TOKENS:
                break
        return (count - 1) / (last - first), count

    def close(self) -> None:
        self.llm.close()
