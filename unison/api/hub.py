"""Models named by their Hugging Face id: `owner/name[:tag][@revision]`, resolved through
huggingface_hub (its cache, `HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_ENDPOINT`, resumed
downloads), once, in the process that starts the core. Every process after it gets a local path
and the commit.

- A GGUF repository gives the one file its tag names (`:Q4_K_M`, any case, as llama.cpp spells
  it), or its split parts, and an `mmproj` file where there is one. Without a tag: Q4_K_M, else
  Q4_K_S, Q4_0, Q8_0; else the tags found are listed.
- A safetensors repository gives what serving reads: the index's shards, configs, tokenizer
  files, chat template, generation and preprocessor configs; never duplicate weight copies
  (`original/`, `metal/`, `consolidated*`, `*.bin`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from unison.config import EngineConfig

# owner/name, then an optional :tag (a GGUF quant) and @revision (a branch, tag or commit).
REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.-]+))?"
                     r"(?:@(?P<rev>[\w./-]+))?")
GGUF_DEFAULT_TAGS = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q8_0")
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
# What serving reads beside the weights (the tokenizer files are model/weights/loader.py's TOKENIZER_FILES).
SERVING_FILES = {"config.json", "generation_config.json", "preprocessor_config.json", "chat_template.jinja",
                 "chat_template.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
                 "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                 "1_Pooling/config.json"}
CHAT_TEMPLATES = "additional_chat_templates/"  # named templates beside the default (tool_use, ...)
SKIPPED_DIRS = ("original/", "metal/")  # duplicate copies of the weights in other formats
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Located:
    """A Hub name made local: the path the engine loads, and what it came from."""

    path: Path  # the snapshot folder (safetensors) or the GGUF file (its first part)
    repo: str  # the name as given (owner/name[:tag][@revision])
    commit: str
    files: tuple[str, ...]  # what was taken, as the repository names them
    mmproj: Path | None = None  # a GGUF repository's vision file (llama.cpp's mmproj), when taken


def is_repo_id(value: str | None) -> bool:
    """A name to resolve on the Hub: not a path that exists, and shaped owner/name[:tag][@rev]."""
    if value is None or value.startswith((".", "/", "~")) or Path(value).expanduser().exists():
        return False
    return REPO_ID.fullmatch(value) is not None


Progress = Callable[[int, int], None]  # (bytes downloaded, bytes in all)


def locate_config(config: EngineConfig, quiet: bool = False,
                  progress: Progress | None = None) -> EngineConfig:
    """The config with its model (and tokenizer_path) made local when given as Hub names; as it
    is otherwise. Refused, naming the repository and what was tried, before any process starts.
    `progress` hears the model's download as it goes (the model pool's web page shows it)."""
    if is_repo_id(config.tokenizer_path):
        assert config.tokenizer_path is not None  # (a repo id)
        tokenizer = locate(config.tokenizer_path, config.revision, config.download_dir, quiet,
                           tokenizer_only=True)
        config = dataclasses.replace(config, tokenizer_path=str(tokenizer.path))
    if not is_repo_id(config.model_path):
        return config
    assert config.model_path is not None  # (a repo id)
    found = locate(config.model_path, config.revision, config.download_dir, quiet, progress=progress)
    mmproj = config.mmproj
    if mmproj is None and found.mmproj is not None and runs_beside(found.path, found.mmproj):
        mmproj = str(found.mmproj)  # the repository's vision file, for a model whose tower Unison runs
    return dataclasses.replace(config, model_path=str(found.path), model_repo=found.repo,
                               model_commit=found.commit, mmproj=mmproj)


def locate(name: str, revision: str | None = None, download_dir: str | None = None, quiet: bool = False,
           tokenizer_only: bool = False, progress: Progress | None = None) -> Located:
    """Download (or find in the cache) what serving `name` needs."""
    from huggingface_hub import constants

    m = REPO_ID.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is neither a path that exists nor a Hugging Face id (owner/name"
                         "[:tag][@revision])")
    repo, tag, rev = m["repo"], m["tag"], m["rev"] or revision or "main"
    say = _printer(quiet)
    if constants.HF_HUB_OFFLINE:
        return _from_cache(name, repo, tag, rev, download_dir, tokenizer_only)
    listing, commit = _listing(name, repo, rev)
    if listing is None:  # the Hub could not be reached: the cache, as huggingface_hub itself falls back
        return _from_cache(name, repo, tag, rev, download_dir, tokenizer_only)
    chosen = _choose(name, listing, tag, tokenizer_only, lambda f: _fetch(repo, f, rev, download_dir))
    say(f"{name}: taking {', '.join(chosen)} (commit {commit[:12]})")
    paths, total, done = [], sum(listing.get(f) or 0 for f in chosen), 0
    with _progress_bars(not quiet and sys.stderr.isatty()):
        for f in chosen:
            size = listing.get(f) or 0
            if not sys.stderr.isatty():
                say(f"downloading {f}" + (f" ({size / 2**20:.1f} MiB)" if size else ""))
            bar = None if progress is None else _reporting(progress, done, total)
            paths.append(_fetch(repo, f, rev, download_dir, bar))
            done += size
            if progress is not None:
                progress(done, total)  # (a file already in the cache makes no bar)
    return _located(name, commit, chosen, paths)


def _located(name: str, commit: str, chosen: list[str], paths: list[Path]) -> Located:
    missing = [f for f, p in zip(chosen, paths, strict=True) if not p.is_file()]
    if missing:  # a partial download never loads as a model
        raise FileNotFoundError(f"{name}: {missing} are not in the cache (an interrupted download: run "
                                "again to resume it)")
    first = paths[0]
    path = first if chosen[0].endswith(".gguf") else first.parents[len(PurePosixPath(chosen[0]).parts) - 1]
    mmproj = next((p for f, p in zip(chosen, paths) if _is_mmproj(f)), None)
    return Located(path, name, commit, tuple(chosen), mmproj)


def _listing(name: str, repo: str, rev: str) -> tuple[dict[str, int | None] | None, str]:
    """The repository's files (name -> size) at `rev`, and its commit; None when the Hub cannot be
    reached. Access errors name what to do."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:  # the endpoint read now (HF_ENDPOINT), not when huggingface_hub was imported
        info = HfApi(endpoint=constants.ENDPOINT).model_info(repo, revision=rev, files_metadata=True)
    except GatedRepoError:
        raise PermissionError(f"{name}: the repository is gated and this token has no access to it: set "
                              "HF_TOKEN to a token of an account that accepted its terms") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{name}: the repository has no revision {rev!r}") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{name}: no such path here, and no repository {repo!r} on the Hub "
                                "(a private one needs HF_TOKEN)") from None
    except (_transport_error(), HfHubHTTPError) as e:
        if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code == 401:
            raise PermissionError(f"{name}: the Hub refused access (401): set HF_TOKEN to a token with "
                                  "access to the repository") from None
        return None, ""
    assert info.sha is not None  # (the Hub names the commit it answered for)
    return {s.rfilename: s.size for s in info.siblings or []}, info.sha


def _transport_error() -> type[Exception]:
    """What huggingface_hub raises when the Hub cannot be reached: its HTTP client's (httpx2 from
    huggingface_hub 2, httpx before)."""
    try:
        import httpx2

        return httpx2.TransportError
    except ImportError:
        import httpx

        return httpx.TransportError


def _choose(name: str, files: Mapping[str, int | None], tag: str | None, tokenizer_only: bool,
            fetch: Callable[[str], Path]) -> list[str]:
    """The files to take from a repository's listing (`fetch` brings the index, to read it)."""
    models = [f for f in files if f.endswith(".gguf") and not _is_mmproj(f)]
    if models and not tokenizer_only:
        return _gguf_files(name, files, models, tag)
    if tag is not None:
        raise ValueError(f"{name}: :{tag} names a GGUF file, and the repository has none")
    extra = sorted(f for f in files if f in SERVING_FILES or f.startswith(CHAT_TEMPLATES))
    if tokenizer_only:
        if "tokenizer.json" not in extra and "tokenizer.model" not in extra:
            raise ValueError(f"{name}: no tokenizer (tokenizer.json or tokenizer.model) in the repository")
        return extra
    if INDEX in files:
        weight_map = json.loads(fetch(INDEX).read_text())["weight_map"]
        return [INDEX, *sorted(set(weight_map.values())), *extra]
    weights = sorted(f for f in files if f.endswith(".safetensors") and "/" not in f
                     and not PurePosixPath(f).name.startswith("consolidated"))
    if weights and "config.json" in files:
        return weights + extra
    kinds = sorted({PurePosixPath(f).suffix or f for f in files if not f.startswith(SKIPPED_DIRS)})
    raise ValueError(f"{name}: nothing Unison can run: it reads GGUF files or safetensors beside a "
                     f"config.json, and the repository holds {kinds}")


def runs_beside(text_model: Path, mmproj: Path) -> bool:
    """Whether Unison runs `mmproj`'s tower beside the GGUF `text_model`: a Gemma 3 with a gemma3
    projector, a Qwen3.5 with a qwen3vl_merger (gguf_header's MMPROJ_PROJECTORS). A repository's
    other vision files are left aside and its text model served alone. (The headers only: this
    process imports no torch.)"""
    from unison.model.weights.gguf_header import MMPROJ_PROJECTORS, read_header

    try:
        arch = read_header(text_model).fields.get("general.architecture")
        projector = read_header(mmproj).fields.get("clip.projector_type")
    except (ValueError, OSError):
        return False
    return isinstance(arch, str) and MMPROJ_PROJECTORS.get(arch) == projector


def _is_mmproj(filename: str) -> bool:  # a vision projector beside the model (llama.cpp's mtmd)
    return PurePosixPath(filename).name.lower().startswith("mmproj")


def gguf_tag(filename: str) -> str:
    """A GGUF file's quant tag as llama.cpp's -hf names it: the part after the last '-' (or '.')
    of the stem, split numbering aside (Qwen3-8B-Q4_K_M-00001-of-00002.gguf: Q4_K_M)."""
    stem = SPLIT.sub("", PurePosixPath(filename).name.removesuffix(".gguf"))
    return re.split(r"[-.]", stem)[-1].upper()


def _gguf_files(name: str, files: Mapping[str, int | None], models: list[str], tag: str | None) -> list[str]:
    tags = {f: gguf_tag(f) for f in models}
    wanted = [tag.upper()] if tag else list(GGUF_DEFAULT_TAGS)
    for want in wanted:
        match = sorted(f for f, t in tags.items() if t == want or SPLIT.sub("", f.removesuffix(".gguf"))
                       .upper().endswith("-" + want))
        if match:
            split = [f for f in match if SPLIT.search(f.removesuffix(".gguf"))]
            chosen = split or match[:1]  # the parts, in order; or the one file
            mmproj = sorted((f for f in files if _is_mmproj(f)), key=lambda f: ("F16" not in f.upper(), f))
            return chosen + mmproj[:1]
    found = sorted(set(tags.values()))
    raise ValueError(f"{name}: " + (f"no GGUF file tagged {tag}" if tag else
                                    f"no GGUF file tagged {' / '.join(GGUF_DEFAULT_TAGS)}; name one")
                     + f": the tags found are {found} (as {name.split(':')[0]}:TAG)")


def _fetch(repo: str, filename: str, rev: str, download_dir: str | None, bar: type | None = None) -> Path:
    from huggingface_hub import constants, hf_hub_download

    return Path(hf_hub_download(repo, filename, revision=rev, cache_dir=download_dir,
                                endpoint=constants.ENDPOINT, tqdm_class=bar))


def _reporting(progress: Progress, before: int, total: int) -> type:
    """A tqdm class for hf_hub_download whose updates reach `progress` (shown as a bar or not)."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.seen = 0

        def update(self, n: float | None = 1) -> bool | None:
            self.seen += int(n or 0)  # counted here: a disabled bar counts nothing
            progress(before + self.seen, total)
            return super().update(n)

    return Reporting


def _from_cache(name: str, repo: str, tag: str | None, rev: str, download_dir: str | None,
                tokenizer_only: bool) -> Located:
    """Offline (HF_HUB_OFFLINE=1, or the Hub unreachable): the revision as the cache holds it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, revision=rev, cache_dir=download_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{name}: offline (HF_HUB_OFFLINE=1, or the Hub unreachable) and the cache "
                                f"has no revision {rev!r} of {repo}: run `unison pull {name}` where the Hub "
                                "is reachable") from None
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    chosen = _choose(name, files, tag, tokenizer_only, lambda f: folder / f)
    return _located(name, folder.name, chosen, [folder / f for f in chosen])


def _printer(quiet: bool) -> Callable[[str], None]:
    if quiet:
        return lambda _: None
    return lambda line: print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """huggingface_hub's bars (bytes and rate) on a terminal; off otherwise (one line per file)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was = not are_progress_bars_disabled()
    (enable_progress_bars if show else disable_progress_bars)()
    try:
        yield
    finally:
        (enable_progress_bars if was else disable_progress_bars)()


@dataclass(frozen=True)
class CachedModel:
    repo: str
    size: int  # bytes on disk, every revision cached
    kind: str  # "gguf: Q4_K_M, Q8_0" or "safetensors"


def cached_models(download_dir: str | None = None) -> list[CachedModel]:
    """The Hugging Face cache's models that Unison can run (`unison models`)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(download_dir)
    except CacheNotFound:
        return []
    rows = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        names = {f.file_name for rev in repo.revisions for f in rev.files}
        paths = {str(f.file_path) for rev in repo.revisions for f in rev.files}
        tags = sorted({gguf_tag(n) for n in names if n.endswith(".gguf") and not _is_mmproj(n)})
        if tags:
            rows.append(CachedModel(repo.repo_id, repo.size_on_disk, "gguf: " + ", ".join(tags)))
        elif "config.json" in names and any(p.endswith(".safetensors") for p in paths):
            rows.append(CachedModel(repo.repo_id, repo.size_on_disk, "safetensors"))
    return rows
