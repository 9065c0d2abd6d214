"""What of the Tinker SDK's client surface this server serves: every public method of ``ServiceClient``,
``TrainingClient``, ``SamplingClient`` and ``RestClient`` (tinker 0.38), served / partial / not served, and why.

``tests/test_tinker_surface.py`` walks the SDK's classes (a method it adds must be placed here) and checks the
table in docs/tinker.md is :func:`markdown` of this one. ``python -m mlora.service.surface`` prints it.
"""

from __future__ import annotations

SERVED, PARTIAL, NOT_SERVED = "served", "partial", "not served"
_NO_PROJECTS = "this server has no projects (one owner per API key)"

# "Class.method" -> (status, what this server does, or why not)
SURFACE: dict[str, tuple[str, str]] = {
    "ServiceClient.create_lora_training_client": (SERVED, "a LoRA adapter of any rank on attention / MLP / lm_head, "
                                                          "its own AdamW; alpha 32"),
    "ServiceClient.create_sampling_client": (SERVED, "from a tinker:// checkpoint or the base"),
    "ServiceClient.create_training_client_from_state": (SERVED, "the weights of a save_state checkpoint"),
    "ServiceClient.create_training_client_from_state_with_optimizer": (SERVED, "weights and AdamW state"),
    "ServiceClient.get_server_capabilities": (SERVED, "the one base (and --model-name)"),
    "ServiceClient.create_rest_client": (SERVED, "client-side; the RestClient rows below"),
    "ServiceClient.copy_weights": (NOT_SERVED, "copies a checkpoint into another project; " + _NO_PROJECTS),
    "ServiceClient.create_custom_loss": (PARTIAL, "runs client-side (the server takes no uploaded loss): a forward, "
                                                  "then cross_entropy with the loss's gradients as weights"),
    "ServiceClient.get_console_url": (NOT_SERVED, "there is no web console"),
    "ServiceClient.get_telemetry": (SERVED, "accepted and dropped"),
    "ServiceClient.close": (SERVED, "ends the session: its models are freed"),
    "TrainingClient.forward_backward": (PARTIAL, "cross_entropy, importance_sampling, ppo, cispo, gspo, dro, as Tinker's "
                                                 "loss pages give them, (N, K) targets; stable_reinforce refused: "
                                                 "its objective is not published"),
    "TrainingClient.forward": (PARTIAL, "as forward_backward, without the backward"),
    "TrainingClient.forward_backward_custom": (SERVED, "the SDK's client-side path (forward, then cross_entropy with "
                                                       "weights -dC/dlogprob); the cookbook's DPO runs through it"),
    "TrainingClient.optim_step": (PARTIAL, "AdamParams (torch's AdamW, grad_clip_norm); Dimuon refused by name"),
    "TrainingClient.get_info": (SERVED, "model id, LoRA rank"),
    "TrainingClient.get_tokenizer": (SERVED, "client-side: the base's tokenizer from its path"),
    "TrainingClient.save_state": (SERVED, "adapter + AdamW state under tinker://<model>/weights/<name>"),
    "TrainingClient.load_state": (SERVED, "the weights into this client"),
    "TrainingClient.load_state_with_optimizer": (SERVED, "weights and AdamW state"),
    "TrainingClient.save_weights_for_sampler": (SERVED, "the PEFT adapter that PEFT and vLLM load"),
    "TrainingClient.save_weights_and_get_sampling_client": (PARTIAL, "unnamed sampler weights; "
                                                                     "record_stability_info (for stable_reinforce) "
                                                                     "refused"),
    "TrainingClient.create_sampling_client": (SERVED, "from a tinker:// path"),
    "TrainingClient.save_weights_external": (SERVED, "the PEFT files (age-encrypted to the recipients given), with a "
                                                     "TTL; downloaded through signed URLs (tinker_cookbook's "
                                                     "weights.download)"),
    "TrainingClient.get_console_url": (NOT_SERVED, "there is no web console"),
    "TrainingClient.get_telemetry": (SERVED, "accepted and dropped"),
    "SamplingClient.sample": (PARTIAL, "continuously batched vLLM; prompt / top-k log-probs, prompt_logprobs_last_n, "
                                       "target_prompt_logprobs, prompt_alt_tokens_k (from the whole next-token "
                                       "distribution, bounded); not images"),
    "SamplingClient.compute_logprobs": (SERVED, "prompt log-probs of a one-token sample"),
    "SamplingClient.create": (SERVED, "client-side constructor"),
    "SamplingClient.from_sampler_handle": (SERVED, "client-side (get_sampler answers)"),
    "SamplingClient.get_sampler_handle": (SERVED, "client-side"),
    "SamplingClient.get_base_model": (SERVED, "the sampler's base"),
    "SamplingClient.get_tokenizer": (SERVED, "client-side: the base's tokenizer from its path"),
    "SamplingClient.on_queue_state_change": (SERVED, "client-side callback; the server reports no queue state"),
    "SamplingClient.get_telemetry": (SERVED, "accepted and dropped"),
    "RestClient.get_sampler": (SERVED, "the sampling session's base and checkpoint"),
    "RestClient.get_server_capabilities": (SERVED, "the one base"),
    "RestClient.get_telemetry": (SERVED, "accepted and dropped"),
}
_RUNS = "the caller's, or with access_scope='accessible' also those with a published checkpoint"
SURFACE.update({f"RestClient.{name}": value for name, value in {
    "assign_session_project": (NOT_SERVED, _NO_PROJECTS),
    "copy_weights": (NOT_SERVED, "copies a checkpoint into another project; " + _NO_PROJECTS),
    "delete_checkpoint": (SERVED, "the owner's only: files and row"),
    "delete_checkpoint_from_tinker_path": (SERVED, "the owner's only: files and row"),
    "export_session_trace": (NOT_SERVED, "no traces are recorded"),
    "get_audit_log": (NOT_SERVED, "there is no audit log"),
    "get_billing_usage": (NOT_SERVED, "there is no billing"),
    "get_current_checkpoint_storage_usage": (SERVED, "the caller's checkpoints: count and bytes (no prices)"),
    "get_external_weights_urls": (SERVED, "a signed URL per file of an export, valid an hour"),
    "get_session": (SERVED, "its training runs, samplers, metadata, display name"),
    "get_training_run": (SERVED, _RUNS),
    "get_training_run_by_tinker_path": (SERVED, _RUNS),
    "get_weights_info_by_tinker_path": (SERVED, "base, rank, trained layers (the owner's or published)"),
    "list_checkpoints": (SERVED, "a run's checkpoints: type, size, public, expires_at"),
    "list_sessions": (SERVED, "the caller's, newest first"),
    "list_training_runs": (SERVED, _RUNS + "; project_id refused: " + _NO_PROJECTS),
    "list_user_checkpoints": (SERVED, "the caller's, newest first, paginated"),
    "publish_checkpoint_from_tinker_path": (SERVED, "every key may read it: weights info, its training run, a "
                                                    "training or sampling client from it"),
    "search_sessions": (NOT_SERVED, "experimental in the SDK; list_sessions and get_session are served"),
    "set_checkpoint_ttl_from_tinker_path": (SERVED, "1 hour to 10 years or None; the checkpoint is deleted when it "
                                                    "runs out"),
    "unpublish_checkpoint_from_tinker_path": (SERVED, "private again"),
    "whoami": (NOT_SERVED, "needs JWT auth; this server takes plain API keys (a key's hash is its owner)"),
}.items()})


def markdown() -> str:
    """The table of docs/tinker.md: one row per SDK method, in class order."""
    rows = ["| SDK method | status | here |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {status} | {note} |" for name, (status, note) in SURFACE.items()]
    counts = {s: sum(v[0] == s for v in SURFACE.values()) for s in (SERVED, PARTIAL, NOT_SERVED)}
    rows.append("")
    rows.append(f"{len(SURFACE)} methods: {counts[SERVED]} served, {counts[PARTIAL]} partial, "
                f"{counts[NOT_SERVED]} not served (tinker 0.38).")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
