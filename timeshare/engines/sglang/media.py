"""Images and videos into SGLang, and nothing dropped on the way (verl #7802).

SGLang's processor takes a token-id prompt with its media: it decodes the ids, finds each
medium's placeholder token (Qwen-VL's `<|image_pad|>`, `<|video_pad|>`) and expands it into that
medium's tokens. A medium without a placeholder of its own is dropped without a word: found here
on a tiny Qwen2-VL, an image sent with a prompt that has no placeholder, or two images with one,
is sampled as if it were not there. So every request is checked twice:

- before it goes: as many placeholders of each kind in its prompt as media of that kind;
- after: the prompt SGLang ran is longer than the one sent (the placeholders were expanded),
  so that what SGLang drops for a reason of its own is caught as well.

Either failure is `UnsupportedInput` naming the request; nothing is sampled without its media.
The placeholders are the model config's (`image_token_id`, `video_token_id`, or the older
`*_token_index`); a medium whose placeholder the config does not name is not taken at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from timeshare.engines.base import RolloutRequest
from timeshare.errors import UnsupportedInput

# The request field of each medium, and where a model's config names its placeholder token.
PLACEHOLDER_KEYS = {
    "images": ("image_token_id", "image_token_index"),
    "videos": ("video_token_id", "video_token_index"),
}


@dataclass(frozen=True)
class MediaPlaceholders:
    """The media a model takes: request field -> the token id its prompt holds for each one."""

    ids: Mapping[str, int]

    @classmethod
    def of_model(cls, model_config: Any) -> MediaPlaceholders:
        """What SGLang's model config says (none for a model SGLang runs as text only)."""
        if not getattr(model_config, "is_multimodal", False):
            return cls({})
        hf_config = getattr(model_config, "hf_config", None)
        ids = {}
        for field, keys in PLACEHOLDER_KEYS.items():
            found = [getattr(hf_config, key, None) for key in keys]
            token = next((value for value in found if isinstance(value, int)), None)
            if token is not None:
                ids[field] = token
        return cls(ids)

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(self.ids)

    def check_request(self, request: RolloutRequest) -> None:
        """Each medium of `request` has a placeholder of its own in the prompt."""
        for field, token in self.ids.items():
            media = len(getattr(request, field))
            if not media:
                continue
            slots = request.prompt_tokens.count(token)
            if slots != media:
                raise UnsupportedInput(
                    f"SGLang rollout: request {request.request_id!r} has {media} {field} and "
                    f"{slots} placeholders for them (token {token}) in its prompt: SGLang would "
                    "drop what has no placeholder of its own"
                )

    @staticmethod
    def check_used(request: RolloutRequest, output: Mapping[str, Any]) -> None:
        """A request with media whose prompt SGLang did not expand was sampled without them."""
        media = request.fields_in_use() & PLACEHOLDER_KEYS.keys()
        used = int(output["meta_info"].get("prompt_tokens", 0))
        if media and used <= len(request.prompt_tokens):
            raise UnsupportedInput(
                f"SGLang sampled request {request.request_id!r} without its "
                f"{', '.join(sorted(media))}: its prompt of {len(request.prompt_tokens)} tokens "
                f"was not expanded ({used} tokens used)"
            )
