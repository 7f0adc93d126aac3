"""Data for the lm-eval parity tasks beside this file, made from the GPL-3 text when lm-eval loads them
(`custom_dataset`), so the tasks need no data file and no download."""
import re
from pathlib import Path

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def _dataset(docs: list[dict]):
    import datasets
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def rolling_docs(**_):
    """Eight paragraphs of the licence, 100 to 1,500 characters: the long ones take several of a tiny model's
    512-token windows."""
    paragraphs = [" ".join(p.split()) for p in GPL3.read_text().split("\n\n")]
    fits = [p for p in paragraphs if 100 <= len(p) <= 1500]
    return _dataset([{"text": p} for p in fits[3::len(fits) // 8][:8]])


def until_docs(**_):
    """Ten sentence openings (their first eight words) and the rest of each sentence as the target."""
    flat = " ".join(GPL3.read_text().split())
    sentences = [s for s in re.split(r"(?<=[.;])\s+(?=[A-Z])", flat) if 14 <= len(s.split()) <= 40]
    docs = [{"context": " ".join(s.split()[:8]), "target": " " + " ".join(s.split()[8:])} for s in sentences]
    return _dataset(docs[::len(docs) // 10][:10])
