"""What tests and benches of causal rerankers share (never imported by the product)."""

# Qwen3-Reranker's template as sentence-transformers 6 ships it: the prompt (a system message) is
# the instruction, then the query and the document, then the assistant turn the model answers in.
QWEN3_RERANKER_TEMPLATE = (
    '{%- set instruction = messages | selectattr("role", "eq", "system") | map(attribute="content") '
    '| first | default("Given a web search query, retrieve relevant passages that answer the query") -%}\n'
    '{%- set query_text = messages | selectattr("role", "eq", "query") | map(attribute="content") | first -%}\n'
    '{%- set document_text = messages | selectattr("role", "eq", "document") | map(attribute="content") '
    '| first -%}\n'
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {{ instruction }}\n<Query>: {{ query_text }}\n"
    "<Document>: {{ document_text }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
