"""Chat templates for tests: ones that cannot switch thinking, to prove what a policy the template cannot honour
does, and one that refuses some conversations."""

# A template without a thinking mode.
PLAIN_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A template that always opens a thinking block, whatever enable_thinking says (a thinking-only model).
THINKING_ONLY_TEMPLATE = PLAIN_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
# A template that refuses conversations whose user and assistant turns do not alternate, as Mistral's and
# Llama 2's do (with a thinking switch, so that every thinking policy is honoured).
ALTERNATING_TEMPLATE = (
    "{%- for m in messages | rejectattr('role', 'equalto', 'system') %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{%- endfor %}"
    + PLAIN_TEMPLATE.replace(
        "'<|im_start|>assistant\\n' }}",
        "'<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    )
)
