"""Chat templates for tests: ones that cannot switch thinking, to prove what a policy the template cannot honour
does."""

# A template without a thinking mode.
PLAIN_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A template that always opens a thinking block, whatever enable_thinking says (a thinking-only model).
THINKING_ONLY_TEMPLATE = PLAIN_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
