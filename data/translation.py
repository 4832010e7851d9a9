"""Parallel text → shared BPE → memory-mapped token ids → token-based batches, sharded per rank.

A corpus folder holds raw text, one sentence per line, `{split}.{lang}` (train.en / train.de, valid.*,
test.*). `prepare_corpus` (run once, by scripts/prepare_wmt.py or scripts/prepare_synthetic_translation.py)
trains one sentencepiece BPE model on both sides of train and writes, per split, under `root/prepared/`:

    {split}.tokens.bin   every kept sentence's ids, source and target, back to back (uint16 or int32)
    {split}.index.npy    one row per kept pair: source offset, source length, target offset, target
                         length, line number in the raw files (references for BLEU come from there)
    spm.model, manifest.json (sizes, dtype, what was skipped; written last: its presence = complete)

Bad input never misaligns the two sides: files with different line counts are an error naming both
files and counts; a pair with an empty side is skipped and counted (prepare time), as is a training pair
longer than `data.max_len` tokens or too long for any batch of `data.max_tokens` (load time).

Batches (`token_batches`) hold at most `data.max_tokens` padded tokens per rank, counted as sentences ×
the longest side (+1 for BOS/EOS). Pairs are sorted by length with a per-epoch random tie-break, packed
greedily, grouped `world` neighbours at a time (so the ranks of one step get batches of similar length)
and the groups shuffled per epoch: every pair is used exactly once per epoch across the ranks, and every
rank runs the same number of steps, which does not change between epochs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from data.config import DataConfigError

PAD, UNK, BOS, EOS = 0, 1, 2, 3
PREPARED = "prepared"
MANIFEST = "manifest.json"
ENCODE_CHUNK = 20000  # lines per sentencepiece call: bounded memory on WMT's 4.5 M lines


class TranslationDataError(DataConfigError):
    """A parallel corpus that cannot be used as is (mismatched sides, missing or unprepared files)."""


@dataclass
class TranslationDataConfig:
    root: str = "datasets/synthetic_en_de"
    """Corpus folder: raw `{split}.{src_lang}` / `{split}.{tgt_lang}` files and the prepared/ ids beside them."""
    src_lang: str = "en"
    """Source language suffix of the raw files."""
    tgt_lang: str = "de"
    """Target language suffix of the raw files."""
    train_split: str = "train"
    """Split trained on."""
    valid_split: str = "valid"
    """Split decoded at every evaluation (time-to-target BLEU)."""
    test_split: str = "test"
    """Held-out split decoded once before and once after training (untrained vs trained BLEU); "" = none."""
    max_tokens: int = 4096
    """Tokens per rank per batch (padded: sentences x longest side incl. BOS/EOS), as fairseq's --max-tokens."""
    max_len: int = 256
    """Training pairs with a side longer than this many BPE tokens are skipped and counted."""
    eval_max_sentences: int = 0
    """Decode only the first this many sentences of valid at each evaluation (0 = all); test is always whole."""

    def __post_init__(self) -> None:
        if self.max_tokens <= 1:
            raise DataConfigError(f"data.max_tokens: must be > 1, got {self.max_tokens}")
        if self.max_len <= 0:
            raise DataConfigError(f"data.max_len: must be > 0, got {self.max_len}")
        if self.eval_max_sentences < 0:
            raise DataConfigError(f"data.eval_max_sentences: must be >= 0, got {self.eval_max_sentences}")


# ---------------------------------------------------------------- preparation


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) + _unterminated(path)


def _unterminated(path: Path) -> int:
    """1 when the file's last line has no newline (it is still a line), else 0."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(size - 1)
        return int(f.read(1) != b"\n")


def split_files(root: Path, split: str, src: str, tgt: str) -> tuple[Path, Path, int]:
    """The two raw files of `split` and their common line count; a clear error if missing or misaligned."""
    paths = (root / f"{split}.{src}", root / f"{split}.{tgt}")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise TranslationDataError(f"{root}: split {split!r} is missing {', '.join(missing)} (one sentence per "
                                   "line, the two sides line-aligned)")
    counts = [count_lines(p) for p in paths]
    if counts[0] != counts[1]:
        raise TranslationDataError(f"{paths[0]} has {counts[0]} lines but {paths[1]} has {counts[1]}: a parallel "
                                   "corpus needs the same number of lines on both sides (line i translates line i)")
    return paths[0], paths[1], counts[0]


def train_bpe(files: list[Path], model_prefix: Path, vocab_size: int, input_sentence_size: int = 2_000_000) -> None:
    """One shared BPE model for both languages (fairseq's joined dictionary, --share-all-embeddings)."""
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(
        input=[str(f) for f in files], model_prefix=str(model_prefix), model_type="bpe", vocab_size=vocab_size,
        character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
        input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
        hard_vocab_limit=False,  # a small corpus may have fewer merges than asked for: take what there is
        num_threads=os.cpu_count() or 1, minloglevel=2)


def _encode_split(sp, src_path: Path, tgt_path: Path, n_lines: int, out: Path, split: str, dtype: np.dtype,
                  max_len: int, progress: bool) -> dict[str, int]:
    from tqdm import tqdm
    stats = {"lines": n_lines, "pairs": 0, "skipped_empty": 0, "skipped_long": 0, "tokens": 0}
    rows: list[np.ndarray] = []
    offset = 0
    threads = os.cpu_count() or 1
    # newline="\n": lines end at \n only, as count_lines counts them (a stray \r inside a line must not split it)
    with open(src_path, encoding="utf-8", newline="\n") as fs, open(tgt_path, encoding="utf-8", newline="\n") as ft, \
            open(out / f"{split}.tokens.bin", "wb") as fout, \
            tqdm(total=n_lines, desc=f"encoding {split}", unit="line", disable=not progress) as bar:
        line_no = 0
        while True:
            src_lines = [line.strip() for _, line in zip(range(ENCODE_CHUNK), fs)]
            tgt_lines = [line.strip() for _, line in zip(range(len(src_lines)), ft)]
            if not src_lines:
                break
            keep = [i for i, (s, t) in enumerate(zip(src_lines, tgt_lines)) if s and t]
            stats["skipped_empty"] += len(src_lines) - len(keep)
            src_ids = sp.encode([src_lines[i] for i in keep], num_threads=threads)
            tgt_ids = sp.encode([tgt_lines[i] for i in keep], num_threads=threads)
            chunk_rows, chunk_ids = [], []
            for i, s, t in zip(keep, src_ids, tgt_ids):
                if max_len and max(len(s), len(t)) > max_len:
                    stats["skipped_long"] += 1
                    continue
                chunk_rows.append((offset, len(s), offset + len(s), len(t), line_no + i))
                chunk_ids += s
                chunk_ids += t
                offset += len(s) + len(t)
            np.asarray(chunk_ids, dtype=dtype).tofile(fout)
            rows.append(np.asarray(chunk_rows, dtype=np.int64).reshape(-1, 5))
            line_no += len(src_lines)
            bar.update(len(src_lines))
    index = np.concatenate(rows) if rows else np.zeros((0, 5), np.int64)
    np.save(out / f"{split}.index.npy", index)
    stats["pairs"], stats["tokens"] = len(index), offset
    return stats


def prepare_corpus(root: str | Path, src: str = "en", tgt: str = "de", vocab_size: int = 32000,
                   splits: tuple[str, ...] = ("train", "valid", "test"), max_len: int = 1024,
                   progress: bool = True) -> dict:
    """Train the shared BPE on train and encode every split into root/prepared/; returns the manifest.

    `max_len` bounds training pairs here already (a safety net against runaway lines; `data.max_len`
    is the training-time limit); the evaluation splits are kept whole so BLEU covers every sentence.
    """
    root = Path(root)
    files = {s: split_files(root, s, src, tgt) for s in splits}  # every split checked before any work
    out = root / PREPARED
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # incomplete until the manifest is written again
    train_src, train_tgt, _ = files[splits[0]]
    train_bpe([train_src, train_tgt], out / "spm", vocab_size)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    dtype = np.dtype(np.uint16 if sp.get_piece_size() <= np.iinfo(np.uint16).max else np.int32)
    manifest = {"src_lang": src, "tgt_lang": tgt, "vocab_size": sp.get_piece_size(), "dtype": dtype.name,
                "splits": {}}
    for s, (src_path, tgt_path, n) in files.items():
        stats = _encode_split(sp, src_path, tgt_path, n, out, s, dtype, max_len if s == splits[0] else 0, progress)
        stats["raw_bytes"] = [src_path.stat().st_size, tgt_path.stat().st_size]
        manifest["splits"][s] = stats
        skipped = stats["skipped_empty"] + stats["skipped_long"]
        if progress and skipped:
            print(f"{s}: skipped {stats['skipped_empty']} pairs with an empty side and {stats['skipped_long']} "
                  f"longer than {max_len} tokens, of {n}")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---------------------------------------------------------------- loading


def prepare_hint(root: str | Path) -> str:
    return (f"prepare it with `python scripts/prepare_wmt.py --root {root}` (from raw {{train,valid,test}}.<lang> "
            "files there, one sentence per line), or use the embedded default: `make transformer-quickstart`")


@dataclass
class Split:
    """One prepared split: ids memory-mapped, pairs indexed; `references[i]` is pair i's raw target line."""

    name: str
    tokens: np.ndarray
    index: np.ndarray
    raw_tgt: Path

    def __len__(self) -> int:
        return len(self.index)

    @property
    def src_lens(self) -> np.ndarray:
        return self.index[:, 1]

    @property
    def tgt_lens(self) -> np.ndarray:
        return self.index[:, 3]

    def src(self, i: int) -> np.ndarray:
        return self.tokens[self.index[i, 0]:self.index[i, 0] + self.index[i, 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tokens[self.index[i, 2]:self.index[i, 2] + self.index[i, 3]]

    def references(self, positions: np.ndarray) -> list[str]:
        """The raw (detokenized) target sentences of the given pairs, in that order."""
        wanted = {int(self.index[p, 4]): k for k, p in enumerate(positions)}
        out = [""] * len(positions)
        with open(self.raw_tgt, encoding="utf-8", newline="\n") as f:
            for line_no, line in enumerate(f):
                if line_no in wanted:
                    out[wanted[line_no]] = line.strip()
        return out


def open_split(root: Path, name: str, manifest: dict) -> Split:
    out = root / PREPARED
    if name not in manifest["splits"]:
        raise TranslationDataError(f"{root}: split {name!r} was not prepared (prepared: "
                                   f"{', '.join(manifest['splits'])}); {prepare_hint(root)}")
    stats = manifest["splits"][name]
    raw_tgt = root / f"{name}.{manifest['tgt_lang']}"
    raw_src = root / f"{name}.{manifest['src_lang']}"
    sizes = [p.stat().st_size if p.is_file() else -1 for p in (raw_src, raw_tgt)]
    if sizes != stats["raw_bytes"]:
        raise TranslationDataError(f"{raw_src} / {raw_tgt} changed since they were prepared (sizes {sizes}, "
                                   f"prepared from {stats['raw_bytes']}); prepare again: {prepare_hint(root)}")
    tokens = (np.memmap(out / f"{name}.tokens.bin", dtype=manifest["dtype"], mode="r") if stats["tokens"]
              else np.zeros(0, manifest["dtype"]))
    return Split(name, tokens, np.load(out / f"{name}.index.npy", mmap_mode="r"), raw_tgt)


def load_manifest(root: str | Path) -> dict:
    root = Path(root)
    path = root / PREPARED / MANIFEST
    if not path.is_file():
        if not root.is_dir():
            raise TranslationDataError(f"{root}: corpus folder not found; {prepare_hint(root)}")
        raise TranslationDataError(f"{root}: no prepared corpus (expected {path}); {prepare_hint(root)}")
    return json.loads(path.read_text())


# ---------------------------------------------------------------- batching


def token_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, world: int, seed: int,
                  epoch: int) -> list[list[np.ndarray]]:
    """This epoch's batches as steps x world arrays of pair positions (step i, rank r: `[i][r]`).

    Every position appears exactly once; each batch has len x max(longest side + 1) <= max_tokens. The
    packing depends only on the sorted lengths, so the number of steps is the same every epoch. A pair
    too long for any batch is an error here: TranslationData skips and counts such pairs first.
    """
    n = len(src_lens)
    if n < world:
        raise TranslationDataError(f"{n} training pairs cannot give each of {world} ranks a batch")
    size = np.maximum(np.asarray(src_lens), np.asarray(tgt_lens)).astype(np.int64) + 1
    if n and size.max() > max_tokens:
        raise TranslationDataError(f"a pair of {size.max()} tokens exceeds data.max_tokens {max_tokens}")
    tie = np.random.default_rng([seed, epoch, 0]).permutation(n)
    order = tie[np.argsort(size[tie], kind="stable")]  # by length; equal lengths in a per-epoch random order
    sorted_size = size[order]
    bounds, start, longest = [0], 0, 0
    for i, s in enumerate(sorted_size):  # ascending: the padded size is count x the last length
        longest = s
        if (i + 1 - start) * longest > max_tokens:
            bounds.append(i)
            start = i
    bounds.append(n)
    batches = [order[a:b] for a, b in zip(bounds, bounds[1:])]
    while len(batches) % world:  # split the biggest batch until the ranks can share them evenly
        big = max(range(len(batches)), key=lambda k: len(batches[k]))
        if len(batches[big]) < 2:
            raise TranslationDataError(f"cannot split {n} pairs into a multiple of {world} batches of at most "
                                       f"{max_tokens} tokens; raise data.max_tokens")
        half = len(batches[big]) // 2
        batches[big:big + 1] = [batches[big][:half], batches[big][half:]]
    groups = [batches[i:i + world] for i in range(0, len(batches), world)]  # neighbours: similar lengths
    perm = np.random.default_rng([seed, epoch, 1]).permutation(len(groups))
    return [groups[g] for g in perm]


def eval_batches(src_lens: np.ndarray, max_tokens: int, rank: int, world: int,
                 limit: int = 0) -> list[np.ndarray]:
    """This rank's share of an evaluation split (every world-th pair), sorted by source length and packed
    by source tokens (decoding memory grows with the output too, so this is a loose bound)."""
    n = min(len(src_lens), limit) if limit else len(src_lens)
    mine = np.arange(rank, n, world)
    mine = mine[np.argsort(np.asarray(src_lens)[mine], kind="stable")]
    out, start = [], 0
    for i in range(len(mine)):
        if (i + 1 - start) * (int(src_lens[mine[i]]) + 1) > max_tokens and i > start:
            out.append(mine[start:i])
            start = i
    if start < len(mine):
        out.append(mine[start:])
    return out


@dataclass
class TranslationBatch:
    """Padded ids: src (B, S) ending in EOS; tgt_in (B, T) starting with BOS; tgt_out (B, T) ending in EOS."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    tokens: int | None = None
    """num_tokens, counted where the batch was still on the host; None: count it from tgt_out."""

    @property
    def num_tokens(self) -> int:
        """Target tokens (EOS included), the unit of loss normalization and of tokens/s (as fairseq's wps)."""
        return int((self.tgt_out != PAD).sum()) if self.tokens is None else self.tokens

    def to(self, device: torch.device) -> TranslationBatch:
        """The batch on `device`, its token count taken before the copy (read from a GPU it is a host sync)."""
        return TranslationBatch(*(t.to(device, non_blocking=True) for t in (self.src, self.tgt_in, self.tgt_out)),
                                tokens=self.num_tokens)


def _pad(seqs: list[np.ndarray], prefix: int | None, suffix: int | None) -> torch.Tensor:
    extra = (prefix is not None) + (suffix is not None)
    out = np.full((len(seqs), max(len(s) for s in seqs) + extra), PAD, dtype=np.int64)
    for row, s in enumerate(seqs):
        col = 0
        if prefix is not None:
            out[row, 0], col = prefix, 1
        out[row, col:col + len(s)] = s
        if suffix is not None:
            out[row, col + len(s)] = suffix
    return torch.from_numpy(out)


def collate(split: Split, positions: np.ndarray) -> TranslationBatch:
    src = [split.src(int(p)) for p in positions]
    tgt = [split.tgt(int(p)) for p in positions]
    return TranslationBatch(_pad(src, None, EOS), _pad(tgt, BOS, None), _pad(tgt, None, EOS))


def collate_src(split: Split, positions: np.ndarray) -> torch.Tensor:
    return _pad([split.src(int(p)) for p in positions], None, EOS)


class TranslationData:
    """A prepared corpus for one rank: the BPE model, the splits, and this rank's batches of an epoch."""

    def __init__(self, cfg: TranslationDataConfig, rank: int = 0, world: int = 1, seed: int = 0) -> None:
        import sentencepiece as spm
        self.cfg, self.rank, self.world, self.seed = cfg, rank, world, seed
        self.root = Path(cfg.root)
        manifest = load_manifest(self.root)
        if (manifest["src_lang"], manifest["tgt_lang"]) != (cfg.src_lang, cfg.tgt_lang):
            raise TranslationDataError(f"{self.root} was prepared for {manifest['src_lang']}->{manifest['tgt_lang']} "
                                       f"but data.src_lang/tgt_lang say {cfg.src_lang}->{cfg.tgt_lang}")
        self.manifest = manifest
        self.sp = spm.SentencePieceProcessor(model_file=str(self.root / PREPARED / "spm.model"))
        self.vocab_size = self.sp.get_piece_size()
        self.train = open_split(self.root, cfg.train_split, manifest)
        self.valid = open_split(self.root, cfg.valid_split, manifest)
        self.test = open_split(self.root, cfg.test_split, manifest) if cfg.test_split else None
        # Training pairs that no batch can hold, or longer than data.max_len: skipped and counted.
        longest = np.maximum(self.train.src_lens, self.train.tgt_lens)
        fits = (longest <= cfg.max_len) & (longest + 1 <= cfg.max_tokens)
        self.train_positions = np.flatnonzero(fits)
        self.skipped_long = int(len(fits) - len(self.train_positions))
        prepared = manifest["splits"][cfg.train_split]
        self.skipped_prepare = prepared["skipped_empty"] + prepared["skipped_long"]
        self._plan_cache: tuple[int, list[list[np.ndarray]]] | None = None

    @property
    def train_size(self) -> int:
        return len(self.train_positions)

    def epoch_plan(self, epoch: int) -> list[list[np.ndarray]]:
        """Steps x ranks of training-pair positions for `epoch` (cached for the current epoch)."""
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            lens_src = self.train.src_lens[self.train_positions]
            lens_tgt = self.train.tgt_lens[self.train_positions]
            plan = token_batches(lens_src, lens_tgt, self.cfg.max_tokens, self.world, self.seed, epoch)
            self._plan_cache = (epoch, [[self.train_positions[b] for b in step] for step in plan])
        return self._plan_cache[1]

    def steps_per_epoch(self) -> int:
        return len(self.epoch_plan(0))

    def train_batches(self, epoch: int, start_step: int = 0) -> Iterator[TranslationBatch]:
        """This rank's batches of `epoch` from `start_step` on (a pure function of seed and epoch)."""
        for step in self.epoch_plan(epoch)[start_step:]:
            yield collate(self.train, step[self.rank])

    def stats(self) -> dict[str, float]:
        return {"data/skipped_pairs": float(self.skipped_long + self.skipped_prepare)}

    def decode(self, ids: list[int]) -> str:
        """BPE ids back to plain text (sentencepiece is its own detokenizer)."""
        return self.sp.decode(ids)
