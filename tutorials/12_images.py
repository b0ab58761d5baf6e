"""Images in a paged engine: an image becomes tokens, an encoder cache, a prefix hash that sees it.

A vision-language model such as LLaVA reads an image as a run of extra prompt positions. Its
vision tower (a ViT) turns the picture into one embedding per patch, a projector maps those into
the decoder's hidden size, and the decoder reads them where the prompt holds the image's
placeholder tokens, as if they were the embeddings of words. Everything after the first layer
is the text path: the same paged KV cache, the same attention, the same sampler.

Three mechanisms make that work in an engine that batches, chunks and caches prompts:

1. placeholders: the prompt's one ``<image>`` is expanded to as many tokens as the image has
   embeddings, so positions, block tables and the token budget count them like any token;
2. the encoder cache: the vision tower runs once per image, and a prompt chunked across steps
   takes the rest of the image's rows from the cache;
3. the prefix hash: placeholder tokens are all the same id, so the block hash chain also hashes
   the picture's content into every block that holds its placeholders.

This lesson builds a tiny random LLaVA and watches each of them, with transformers as the
reference for every token; then a tiny Qwen2-VL, whose pictures keep their own size and whose
tokens carry three positions each (M-RoPE).
"""

import shutil
import tempfile
from pathlib import Path

import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing_multimodal import (
    make_tiny_llava_checkpoint,
    make_tiny_qwen2_vl_checkpoint,
    tiny_test_images,
    transformers_llava_greedy,
    transformers_qwen2_vl_greedy,
)

torch.set_num_threads(2)
work = Path(tempfile.mkdtemp(prefix="images-tutorial-"))
model = make_tiny_llava_checkpoint(work / "llava")
cat, dog, bird = tiny_test_images()
greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

# ## 1. An image becomes tokens
#
# The prompt holds one placeholder. The engine runs the picture through the model folder's own
# image processor (resize, crop, normalise: what the model was trained with) and expands the
# placeholder to one token per embedding: the tiny tower cuts a 32-pixel image into 8-pixel
# patches, 16 of them (LLaVA-1.5 at 336 px: 576).

llm = LLM(model=str(model), dtype="float32", max_model_len=256, block_size=8)
placeholder = llm.engine.image_placeholder
prompt = (
    f"USER: Here is a photo from my holiday by the sea. {placeholder}\nWhat is in it? ASSISTANT:"
)
text_ids = llm.get_tokenizer().encode(prompt)
expanded, images = llm.engine.image_processor.process(text_ids, {"image": [cat]})
image = images[0]
print(f"== 1. {placeholder!r} once in {len(text_ids)} tokens -> {len(expanded)} tokens")
print(f"   the picture {cat.size} -> pixels {tuple(image.pixel_values.shape)}; placeholders at")
print(
    f"   [{image.offset}, {image.offset + image.length}), content hash {image.content_hash.hex()[:16]}"
)
(rows,) = llm.engine.runner.model.embed_images([image.pixel_values])
print(f"   the vision tower and projector: {tuple(rows.shape)} (rows, decoder width)")

# ## 2. Equal to transformers
#
# The runner builds the step's input embeddings from the text embedding of every token, then
# writes the image's rows over its placeholders. Greedy tokens through the paged cache equal
# transformers' own LlavaForConditionalGeneration.

(out,) = llm.generate(
    {"prompt": prompt, "multi_modal_data": {"image": [cat]}}, greedy, use_tqdm=False
)
_, expected = transformers_llava_greedy(model, prompt, [cat], 16)
print(f"== 2. pagedserve {list(out.outputs[0].token_ids)[:8]}...")
print(f"   transformers {expected[:8]}...  equal: {list(out.outputs[0].token_ids) == expected}")

# ## 3. The encoder cache
#
# With a token budget of 8 a step, the prompt is read in chunks, and a chunk ends in the middle
# of the image. The scheduler's half of the encoder cache schedules the image's encoding in the
# first chunk that touches it; later chunks take the rest of its rows from the runner's cache.
# The count of images encoded stays one per picture, however many chunks read it.

chunked = LLM(model=str(model), dtype="float32", max_model_len=256, max_num_batched_tokens=8)
two = f"USER: {placeholder} and {placeholder}\nCompare them. ASSISTANT:"
(out,) = chunked.generate(
    {"prompt": two, "multi_modal_data": {"image": [dog, bird]}}, greedy, use_tqdm=False
)
_, expected = transformers_llava_greedy(model, two, [dog, bird], 16)
stats = chunked.engine.get_stats()
steps = -(-len(out.prompt_token_ids) // 8)
print(f"== 3. a {len(out.prompt_token_ids)}-token prompt with two images read in {steps} chunks:")
print(f"   images encoded {stats.encoder_cache_encoded}; equal to transformers: "
      f"{list(out.outputs[0].token_ids) == expected}")  # fmt: skip

# ## 4. A prefix hash that sees the picture
#
# The same text with another picture has exactly the same token ids. Hashing only tokens would
# serve the dog's question the cat's keys and values; the chain hashes each image's content
# into the blocks its placeholders fill, so the first such block, and every block after it,
# differs, while the blocks before the image stay shared with any prompt of the same text. The
# same picture again (another object with the same pixels) hits every full block; its
# placeholders all come from the prefix cache, so the encoder is not even asked for it.

kv = llm.engine.kv_cache_manager
_, dog_images = llm.engine.image_processor.process(text_ids, {"image": [dog]})
cat_hashes = kv.hash_prefix(expanded, len(expanded), images=images)
dog_hashes = kv.hash_prefix(expanded, len(expanded), images=dog_images)
same = [a == b for a, b in zip(cat_hashes, dog_hashes, strict=True)]
print(f"== 4. block hashes, cat vs dog prompt, same token ids: equal per block {same}")
for picture, name in ((dog, "dog"), (cat.copy(), "cat again")):
    (out,) = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": [picture]}}, greedy, use_tqdm=False
    )
    cached = out.num_cached_tokens
    print(f"   {name:>9}: {cached:2d} of {len(expanded)} prompt tokens from the prefix cache")
# The cat once more, after other words: no block of this prompt was computed before, but the
# image's embeddings are still in the encoder cache, so the vision tower does not run again.
other_text = f"USER: {placeholder}\nDescribe it in one word. ASSISTANT:"
llm.generate({"prompt": other_text, "multi_modal_data": {"image": [cat]}}, greedy, use_tqdm=False)
stats = llm.engine.get_stats()
print(
    f"   images encoded {stats.encoder_cache_encoded}, encoder cache hits {stats.encoder_cache_hits}"
)

# ## 5. Dynamic resolution and M-RoPE (Qwen2-VL)
#
# LLaVA squeezes every picture into one square: every image is 16 tokens here, 576 in the real
# model. Qwen2-VL keeps a picture near its own size: the processor cuts it into patches (4 px
# here, 14 px in the real model), and the tower merges each 2 x 2 block of patches into one
# decoder row, so a bigger picture takes more tokens. Its decoder gives each token three
# positions (time, height, width): text has the three equal; an image's rows sit on a grid
# that starts where the image starts, and the text after it goes on from there plus the grid's
# longer side. The runner computes them for any chunk from where the request's images sit.

qwen = LLM(model=str(make_tiny_qwen2_vl_checkpoint(work / "qwen2_vl")), dtype="float32")
marker = "<|vision_start|><|image_pad|><|vision_end|>"
qwen_prompt = f"User: {marker}What is it? Assistant:"
qwen_ids = qwen.get_tokenizer().encode(qwen_prompt)
print("== 5. Qwen2-VL: each picture its own number of tokens")
for picture, name in ((cat, "cat"), (dog, "dog")):
    ids, (image,) = qwen.engine.image_processor.process(qwen_ids, {"image": [picture]})
    t, h, w = image.grid_thw
    print(f"   {name} {picture.size}: a {h} x {w} grid of patches -> {image.length} tokens")
ids, images = qwen.engine.image_processor.process(qwen_ids, {"image": [cat]})
positions = qwen.engine.runner.model.mrope_positions(torch.arange(len(ids)).numpy(), images)
start, end = images[0].offset, images[0].offset + images[0].length
print("   positions (time, height, width) of the tokens before, in and after the image:")
for i in (start - 1, start, start + 1, start + 5, end - 1, end, len(ids) - 1):
    print(f"     token {i:3d}: {tuple(int(p) for p in positions[:, i])}")
(out,) = qwen.generate(
    {"prompt": qwen_prompt, "multi_modal_data": {"image": [cat]}}, greedy, use_tqdm=False
)
_, expected = transformers_qwen2_vl_greedy(work / "qwen2_vl", qwen_prompt, [cat], 16)
print(f"   equal to transformers: {list(out.outputs[0].token_ids) == expected}")

for engine in (llm, chunked, qwen):
    engine.engine.shutdown()
shutil.rmtree(work)  # the lesson's tiny checkpoint
