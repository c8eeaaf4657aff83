"""The peer registry: one entry per runtime a user would pick instead of ours.

Every layer that lists, names or colours a peer reads `PEERS` (the benchmark runs them, reports and
screens label them); adding a peer is an entry here plus its loader and converter in `bench/peers/`.
The entries extend `RuntimeSpec`, the description our backends share. Data only, no imports beyond
this package: the peers' own environment (`.venv-bench`) reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import RuntimeSpec


@dataclass(frozen=True)
class PeerSpec(RuntimeSpec):
    # "project": the project's own environment; "bench": .venv-bench, because Optimum needs an
    # older transformers than the project pins.
    environment: str
    library: str  # "transformers", "optimum" or "ctranslate2": which loader runs it
    converts_with: str  # the converter, in words
    # How the model reaches it: None reads the source folder as is; otherwise the folder under the
    # peer cache its conversion writes, and the peer whose conversion it starts from (if any).
    converted_into: str | None = None
    converted_from: str | None = None


PEERS: dict[str, PeerSpec] = {
    "transformers": PeerSpec(
        name="transformers", label="generate() (PyTorch)", colour="#ff7f0e", precision="fp32", exact=True,
        environment="project", library="transformers", converts_with="none: the family's transformers class reads the source folder",
    ),
    "optimum_fp32": PeerSpec(
        name="optimum_fp32", label="Optimum ORT fp32", colour="#17becf", precision="fp32", exact=True,
        environment="bench", library="optimum", converted_into="optimum",
        converts_with="optimum-cli export onnx --task text2text-generation-with-past (merged decoder with past)",
    ),
    "optimum_int8": PeerSpec(
        name="optimum_int8", label="Optimum ORT int8", colour="#bcbd22", precision="int8", exact=False,
        environment="bench", library="optimum", converted_into="optimum-int8", converted_from="optimum_fp32",
        converts_with="Optimum's ORTQuantizer, dynamic int8, over the fp32 export's encoder and merged decoder",
    ),
    "ct2_float32": PeerSpec(
        name="ct2_float32", label="CTranslate2 float32", colour="#8c564b", precision="fp32", exact=True,
        environment="bench", library="ctranslate2", converted_into="ct2-float32",
        converts_with="ct2-transformers-converter's loader for the family, --quantization float32",
    ),
    "ct2_int8": PeerSpec(
        name="ct2_int8", label="CTranslate2 int8", colour="#e377c2", precision="int8", exact=False,
        environment="bench", library="ctranslate2", converted_into="ct2-int8",
        converts_with="ct2-transformers-converter's loader for the family, --quantization int8",
    ),
}

PEER_NAMES = tuple(PEERS)
IN_PROJECT_ENV = tuple(n for n, p in PEERS.items() if p.environment == "project")


def is_ct2(name: str) -> bool:
    """A CTranslate2 peer: it reads no generation config and has its own CPU settings to probe."""
    return name in PEERS and PEERS[name].library == "ctranslate2"
