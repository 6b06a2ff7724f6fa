"""Scores for the demo's data-to-text task: corpus BLEU (sacrebleu) and slot realisation.

**Slot realisation accuracy** (the E2E challenge's slot error rate, made exact for this data
set): a meaning representation ``name[Cotto], eatType[pub], familyFriendly[yes]`` has one slot
per ``key[value]``. A slot is *realised* when the generated text states its value:

* ``familyFriendly[yes]``: "family friendly", "kids are welcome" or "children are welcome"
  appears and no negated form does; ``familyFriendly[no]``: "not family friendly", "not
  suitable for children" or "no kids" appears;
* every other slot: the value appears verbatim (case-insensitive, on word boundaries), e.g.
  ``priceRange[£20-25]`` needs "£20-25", ``customer rating[5 out of 5]`` needs "5 out of 5",
  outside the representation's other values that contain it (``food[Indian]`` is not
  realised by the "Indian" of ``near[Raja Indian Cuisine]``).

``slot_accuracy`` = realised slots / all slots over the held-out set; ``all_slots`` = the
fraction of examples with every slot realised; ``added`` = slot values the text states that
the representation does not hold (another restaurant's name, another cuisine, area, eat type
or landmark) outside the representation's own values ("Indian food" beside
``near[Raja Indian Cuisine]`` is added, the landmark's name alone is not), per example:
hallucinations, which slot accuracy alone would not punish. The
reference sentences score slot accuracy 1.0 and added 0 (a test checks this).
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence

from kfused.data.make_e2e import AREA, EAT, FOOD, NAMES, NEAR

_MR = re.compile(r"\s*([^\[\],]+)\[([^\]]*)\]")
_YES = ("family friendly", "kids are welcome", "children are welcome")
_NO = ("not family friendly", "not suitable for children", "no kids", "not kid friendly",
       "not child friendly")
_POOLS = {"name": NAMES, "food": FOOD, "area": AREA, "eatType": EAT, "near": NEAR}


def parse_mr(mr: str) -> Dict[str, str]:
    """``"name[X], food[Y]"`` -> ``{"name": "X", "food": "Y"}``. A key given twice, text
    that is not ``key[value]`` slots separated by commas, or no slot at all is a ValueError
    (the last value was kept and the rest dropped: the slot scores counted something else
    than the MR)."""
    slots: Dict[str, str] = {}
    rest = _MR.sub(",", mr)
    if rest.replace(",", "").strip():
        raise ValueError(f"meaning representation {mr!r}: expected comma-separated key[value] "
                         f"slots, found {rest.replace(',', ' ').strip()!r} outside them")
    for k, v in _MR.findall(mr):
        k = k.strip()
        if k in slots:
            raise ValueError(f"meaning representation {mr!r} gives slot {k!r} twice")
        slots[k] = v.strip()
    if not slots:  # an empty example counted as complete in all_slots
        raise ValueError(f"meaning representation {mr!r} holds no key[value] slot")
    return slots


def _pattern(value: str) -> str:
    return r"(?<!\w)" + re.escape(value) + r"(?!\w)"


def _has(text: str, value: str, case: bool = False) -> bool:
    return re.search(_pattern(value), text, 0 if case else re.IGNORECASE) is not None


def _without(text: str, values) -> str:
    """``text`` with every occurrence of ``values`` (longest first) blanked out."""
    for v in sorted(values, key=len, reverse=True):
        text = re.sub(_pattern(v), " ", text, flags=re.IGNORECASE)
    return text


def slot_realised(key: str, value: str, text: str) -> bool:
    if key == "familyFriendly":
        low = text.lower()
        neg = any(p in low for p in _NO)
        if value.lower() == "no":
            return neg
        return not neg and any(p in low for p in _YES)
    return _has(text, value)


def added_values(slots: Dict[str, str], text: str) -> List[str]:
    """Values of name/food/area/eatType/near stated in ``text`` (outside the values of
    ``slots``) but absent from ``slots``."""
    rest = _without(text, [v for v in slots.values() if v])
    out = []
    for key, pool in _POOLS.items():
        for value in pool:
            if slots.get(key) == value:
                continue
            if _has(rest, value, case=key in ("name", "near")):
                out.append(f"{key}[{value}]")
    return out


def _realised(slots: Dict[str, str], text: str) -> List[bool]:
    """slot_realised for each slot, a value not counted where it is part of another slot's
    value (food[Indian] inside near[Raja Indian Cuisine])."""
    hit = []
    for k, v in slots.items():
        inside = [o for kk, o in slots.items() if kk != k and o.lower() != v.lower()
                  and v and _has(o, v)]
        hit.append(slot_realised(k, v, _without(text, inside) if inside else text))
    return hit


def _same_lengths(**named: Sequence[str]) -> None:
    """One text per example: lists of different lengths (or none at all) are an error, not
    a score over the shorter one."""
    lengths = {k: len(v) for k, v in named.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError("one entry per example expected; got " +
                         ", ".join(f"{len(v)} {k}" for k, v in named.items()))
    if not any(lengths.values()):
        raise ValueError(f"no examples to score ({', '.join(lengths)} are empty)")


def slot_scores(mrs: Sequence[str], texts: Sequence[str]) -> Dict[str, float]:
    _same_lengths(mrs=mrs, texts=texts)
    total = realised = complete = added = 0
    for mr, text in zip(mrs, texts):
        slots = parse_mr(mr)
        hit = _realised(slots, text)
        total += len(hit)
        realised += sum(hit)
        complete += all(hit)
        added += len(added_values(slots, text))
    n = max(len(mrs), 1)
    return {"slot_accuracy": realised / max(total, 1), "all_slots": complete / n,
            "added_per_example": added / n, "slots": total}


def bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu defaults: 13a tokenisation, one reference per example)."""
    import sacrebleu

    _same_lengths(hyps=hyps, refs=refs)
    return float(sacrebleu.corpus_bleu(list(hyps), [list(refs)]).score)


def score(mrs: Sequence[str], hyps: Sequence[str], refs: Sequence[str]) -> Dict[str, float]:
    _same_lengths(mrs=mrs, hyps=hyps, refs=refs)
    return {"bleu": bleu(hyps, refs), **slot_scores(mrs, hyps)}
