"""A model's tokenizer files from the Hugging Face hub, fetched once into a local cache.

`huggingface_hub.hf_hub_download` does the HTTP: a HEAD on `{endpoint}/{repo}/resolve/{revision}/{file}`
(following redirects on the hub's own host; a redirect elsewhere, to a CDN, carries the file's metadata in
X-Linked-Etag / X-Linked-Size and is fetched without the token), then a GET of the file into the cache
(`blobs/` by ETag, `snapshots/{commit}/` by name), so a later start reuses the files without downloading
them again. It reads HF_ENDPOINT, HF_TOKEN, HF_HOME and HF_HUB_OFFLINE from the environment when
the arguments here are None.

Only tokenizer files are fetched (never weights): tokenizer.json and tokenizer_config.json are
required; special_tokens_map.json, added_tokens.json, chat_template.jinja and chat_template.json are
taken when the repository has them. Blocking: run it in a thread.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REQUIRED = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


class HubError(Exception):
    """The files could not be had (no such repository or file, no access, hub unreachable)."""


@dataclass(frozen=True)
class HubOptions:
    endpoint: str | None = None  # None: HF_ENDPOINT, else https://huggingface.co
    token: str | None = None  # None: HF_TOKEN or the saved login
    cache_dir: str | None = None  # None: HF_HUB_CACHE / HF_HOME's hub/
    revision: str = "main"
    timeout_s: float = 10.0


def fetch(repo_id: str, options: HubOptions = HubOptions()) -> Path:
    """The directory holding `repo_id`'s tokenizer files (downloaded now or found in the cache)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    def one(filename: str) -> Path:
        return Path(hf_hub_download(repo_id, filename, revision=options.revision, cache_dir=options.cache_dir,
                                    endpoint=options.endpoint, token=options.token, etag_timeout=options.timeout_s))

    try:
        paths = [one(f) for f in REQUIRED]
    except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise HubError(f"cannot fetch the tokenizer of {repo_id!r}: {type(e).__name__}: {e}") from e
    directory = paths[0].parent
    for filename in OPTIONAL:
        try:
            one(filename)
        except EntryNotFoundError:  # not in the repository (or, offline, not in the cache)
            continue  # most repositories have only some of them; verification catches a missing template
        except (HfHubHTTPError, OSError, ValueError) as e:
            # A file the repository may have but that could not be fetched: the template might be missing.
            raise HubError(f"cannot fetch {filename} of {repo_id!r}: {type(e).__name__}: {e}") from e
    log.info("tokenizer files of %r at %s", repo_id, directory)
    return directory
