"""Integrations of deltatron's ops into other libraries' models. Each submodule imports its library only when
imported itself: `from deltatron.integrations import transformers` needs Hugging Face transformers installed."""
