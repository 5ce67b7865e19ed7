"""Secrets hidden from the config wherever it is stored or logged, and from free text.

Holds:

- ``is_secret_key``: the rule for secret-looking keys (words, not substrings: ``api_token``,
  ``passwd``, ``GITHUB_PAT``, ``HF_AUTH``, ``AccountKey`` are secret; ``tokenizer``,
  ``num_tokens``, ``author``, ``monkey`` are not);
- ``redact``: a config (or any JSON-able value) with every value under a secret-looking key
  (but a number under one that names a count or an index: ``pad_token_id: 0``,
  ``num_key_value_heads: 2``), every value of an ``env_vars`` mapping and every credential
  inside a string replaced, at any depth, in every section;
- ``redact_text``: credentials inside free text replaced: a URL's userinfo, ``name=value`` and
  quoted ``'name': 'value'`` pairs with a secret-looking name (connection strings, query
  strings, a dict's repr in an exception), and tokens by their shape wherever they stand (an
  ``Authorization`` scheme's credentials, JWTs, Hugging Face, GitHub, Slack, OpenAI-style and
  AWS access key ids: ``_TOKEN_SHAPES``);
- ``RedactingFilter``: a logging filter that passes every record's message through ``redact_text``;
- ``has_secrets`` (whether ``redact`` would hide anything but ``env_vars`` values: the warning
  that Ray logs its runtime env) and ``REDACTED``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["REDACTED", "RedactingFilter", "has_secrets", "is_secret_key", "redact", "redact_text"]

REDACTED = "***"

# A key is split into words (snake_case, kebab-case, dotted and camelCase) and is secret when a
# word is one of these: whole words, so `tokenizer`, `num_tokens` and `keyboard` are not.
_SECRET_WORDS = frozenset(
    {
        "apikey",
        "auth",
        "authorization",
        "bearer",
        "cookie",
        "credential",
        "credentials",
        "creds",
        "key",
        "pass",
        "passphrase",
        "passwd",
        "password",
        "passwords",
        "pat",
        "private",
        "pwd",
        "sas",
        "secret",
        "secrets",
        "sig",
        "signature",
        "token",
    }
)
# ...or ends with one of these (keys written as one word: `authtoken`, `clientsecret`, `accountkey`).
_SECRET_SUFFIXES = (
    "accesskey",
    "accountkey",
    "apikey",
    "auth",
    "credential",
    "credentials",
    "passwd",
    "password",
    "privatekey",
    "secret",
    "secretkey",
    "token",
)
_WORD_RE = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
# scheme://user:password@host (or scheme://token@host): the userinfo of a URL.
# Greedy up to the last "@" before the path: a password may hold an unencoded "@".
_USERINFO_RE = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/?#]+)@")
# name=value in connection strings (`;`-separated) and query strings (`&`-separated).
_PAIR_RE = re.compile(r"(?P<name>[A-Za-z][\w.\-]*)=(?P<value>[^;&\s\"',]+)")
# 'name': 'value' (a dict's repr, JSON) and name: value (a header line).
_QUOTED_PAIR_RE = re.compile(
    r"(?P<q>['\"]?)(?P<name>[A-Za-z][\w.\-]*)(?P=q)\s*:\s*(?P<vq>['\"])(?P<value>[^'\"]*)(?P=vq)"
)
# Tokens told by their shape, whatever names them (an exception's text rarely names its key).
_TOKEN_SHAPES = re.compile(
    r"(?P<scheme>\b(?:Bearer|Basic|Token|Digest)\s+)[A-Za-z0-9._~+/=\-]{8,}"  # an Authorization value
    r"|\beyJ[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]{4,}"  # a JWT
    r"|\bhf_[A-Za-z0-9]{16,}"  # Hugging Face
    r"|\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"  # GitHub
    r"|\bxox[abposr]-[A-Za-z0-9\-]{10,}"  # Slack
    r"|\bsk-[A-Za-z0-9_\-]{20,}"  # OpenAI-style API keys
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"  # AWS access key ids
)


# A number under a key whose last word is one of these is a count, a size or an index, not a
# credential: the model configs' ``pad_token_id``, ``eos_token_id``, ``num_key_value_heads``.
_NUMBER_WORDS = frozenset({"count", "dim", "heads", "id", "ids", "index", "len", "length", "size"})


def _words(key: str) -> list[str]:
    return [w.lower() for w in _WORD_RE.findall(key)]


def _secret_words(words: list[str]) -> bool:
    return any(w in _SECRET_WORDS or w.endswith(_SECRET_SUFFIXES) for w in words)


def _hidden(key: object, value: Any) -> bool:
    """Whether ``value`` under ``key`` is hidden: a secret-looking key, unless the value is a
    number (not a string) and the key's last word names a count or an index."""
    words = _words(str(key))
    if not _secret_words(words):
        return False
    counted = isinstance(value, int | float) and not isinstance(value, bool) and words[-1] in _NUMBER_WORDS
    return not counted


def is_secret_key(key: object) -> bool:
    """Whether values under ``key`` are treated as secrets (see the module's docstring)."""
    return _secret_words(_words(str(key)))


def _userinfo(match: re.Match[str]) -> str:
    user, sep, _ = match["userinfo"].partition(":")
    # user:password keeps the user; a lone user part may itself be a token (https://TOKEN@host).
    return f"{match['scheme']}{user}:{REDACTED}@" if sep else f"{match['scheme']}{REDACTED}@"


def _pair(match: re.Match[str]) -> str:
    return f"{match['name']}={REDACTED}" if is_secret_key(match["name"]) else match[0]


def redact_text(text: str) -> str:
    """``text`` with URL userinfo, secret-looking ``name=value`` and ``'name': 'value'`` values
    and tokens of a known shape replaced by ``REDACTED``."""
    if "@" in text:
        text = _USERINFO_RE.sub(_userinfo, text)
    if "=" in text:
        text = _PAIR_RE.sub(_pair, text)
    if ":" in text:
        text = _QUOTED_PAIR_RE.sub(_quoted_pair, text)
    return _TOKEN_SHAPES.sub(lambda m: f"{m['scheme'] or ''}{REDACTED}", text)


def _quoted_pair(match: re.Match[str]) -> str:
    if not is_secret_key(match["name"]) or match["value"] in ("", REDACTED):
        return match[0]
    q, vq = match["q"], match["vq"]
    return f"{q}{match['name']}{q}: {vq}{REDACTED}{vq}"


def redact(value: Any, *, all_values: bool = False) -> Any:
    """``value`` with secrets replaced by ``REDACTED``, in mappings and lists at any depth: every
    value under a secret-looking key (``is_secret_key``), every value of an ``env_vars`` mapping
    (any variable can carry a credential: ``DATABASE_URL``, ``HF_AUTH``), and credentials inside
    strings (``redact_text``). Keys are kept, so the shape of the config stays readable."""
    if isinstance(value, dict):
        return {
            k: REDACTED
            if all_values or _hidden(k, v)
            else redact(v, all_values=str(k) == "env_vars" and isinstance(v, dict))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [REDACTED if all_values else redact(v) for v in value]
    if all_values:
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    return value


def has_secrets(value: Any) -> bool:
    """Whether ``value`` holds a secret-looking key or a credential inside a string (``env_vars``
    values count only when they look like one: their names and contents are checked)."""
    if isinstance(value, dict):
        return any(_hidden(k, v) or has_secrets(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_secrets(v) for v in value)
    return isinstance(value, str) and redact_text(value) != value


class RedactingFilter(logging.Filter):
    """Passes each record's message through ``redact_text`` (installed on the CLI's log handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: logging reports it itself
            return True
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True
