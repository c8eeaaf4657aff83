"""The runtimes a user would pick instead of ours, timed by the same protocol in the same run.

The registry (`runtime/peers.py`, below every layer, so reports and screens can label them too)
names them; each is a `runtime.RuntimeSpec` as our backends are:

- `transformers`: the family's transformers class `generate()` (PyTorch eager), in the project's
  own environment.
- `optimum_fp32`: Hugging Face Optimum's `ORTModelForSeq2SeqLM` over its own export
  (`optimum-cli export onnx --task text2text-generation-with-past`, merged decoder with past).
- `optimum_int8`: the same, its encoder and merged decoder quantized by Optimum's `ORTQuantizer`
  (dynamic int8, `AutoQuantizationConfig.avx512_vnni` or `.avx2` after the CPU's flags).
- `ct2_float32`, `ct2_int8`: CTranslate2 `Translator` over the output of `ct2-transformers-converter`'s
  loader for the family (`--quantization float32` / `int8`), `translate_batch(beam_size=N)`, run
  through `python -m bench.peers ct2-convert`, which starts the decoder where transformers does
  (`ct2_convert.py` says how).

Every family of the export runs: the model class and tokenizer come from the family registry
(`families/`), the languages from the export's sidecar (`model.PeerModel`): the source
language's code prefixes each source, the target's is forced first (generate()'s
`forced_bos_token_id`, CTranslate2's `target_prefix`).

Optimum needs transformers<4.58, the project needs 5.x, so Optimum and CTranslate2 live in their own
environment, `.venv-bench` (`make bench-venv`, from requirements-bench.txt). The parent process
(`python -m bench speed --peers`) converts the model once per source weights into
`exports/peers/<export name>/` with that environment's tools (`convert.py`), then runs each peer in
its own subprocess of that environment: `python -m bench.peers worker ...` (`worker.py`), which
imports only this package and the measurement protocol (`runtime/`), and writes its results as JSON.

Decoding: `--num-beams N` (default 1, greedy) on the worker's command line, as `python -m bench speed
--num-beams N` passes it. transformers and Optimum call `generate(num_beams=N, do_sample=False)` and
take length_penalty / early_stopping from the model folder's generation config unless
`--length-penalty` / `--early-stopping` are given; CTranslate2 runs `beam_size=N` with the given
length_penalty (it reads no generation config) and its own stopping rule (patience 1). CTranslate2
scores hypotheses its own way, so at N > 1 its outputs are compared as agreement, never expected
identical.
"""

from .convert import prepare
from .ct2 import CT2_GEMMS, ct2_kwargs, ct2_setting_args, ct2_settings
from .hf import early_stopping_arg, generate_kwargs
from .model import PeerModel
from .specs import DEFAULT_PEER_PYTHON, IN_PROJECT_ENV, PEER_CACHE, PEER_NAMES, PEERS, PeerSpec, is_ct2, peer

__all__ = ["CT2_GEMMS", "DEFAULT_PEER_PYTHON", "IN_PROJECT_ENV", "PEERS", "PEER_CACHE", "PEER_NAMES", "PeerModel",
           "PeerSpec", "ct2_kwargs", "ct2_setting_args", "ct2_settings", "early_stopping_arg", "generate_kwargs",
           "is_ct2", "peer", "prepare"]
