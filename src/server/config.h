/* config: fitmd's settings, from one table (name, type, default, bounds, help).
 *
 * Precedence: command-line flags > FITM_* environment variables > config file > defaults.
 * Every value is validated against the table; errors quote the offending flag, variable or
 * file line. The same table prints --help and writes the documented config file. */
#ifndef FITM_CONFIG_H
#define FITM_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "base/status.h"
#include "pipeline/score.h"


#define FITM_CONFIG_STR_BYTES 1024

typedef struct {
    char model[FITM_CONFIG_STR_BYTES];     /* local GGUF path                          */
    char model_url[FITM_CONFIG_STR_BYTES]; /* downloaded to model when that is missing */
    char model_sha256[72];                 /* model_url's expected digest; "" = unchecked */
    char model_load[8];                    /* mmap | copy                               */
    char model_name[128];                  /* id reported by /v1/models; "" = file name */
    char strict_model[8];                  /* true: refuse requests naming another model */
    char host[256];
    int64_t port;
    int64_t probe_port;                    /* /health and /metrics only; 0 = none      */
    char backend[16];                      /* auto | cpu | cuda                        */
    char gpu_weights[8];                   /* bf16 | f32                               */
    int64_t threads;                       /* CPU compute threads; 0 = all cores       */
    int64_t http_threads;
    int64_t http_idle_timeout_s;           /* close connections idle this long         */
    int64_t max_connections;               /* open connections at once                 */
    int64_t max_connections_per_client;    /* ... from one client address              */
    int64_t http_header_timeout_s;         /* request head receive deadline (408)       */
    int64_t http_receive_timeout_s;        /* whole-body receive deadline (408)        */
    char api_keys[FITM_CONFIG_STR_BYTES];  /* comma-separated bearer keys; "" = open   */
    char cors_origins[FITM_CONFIG_STR_BYTES]; /* "*" or comma-separated origins; "" = no CORS */
    int64_t max_body_bytes;
    int64_t max_json_members;
    int64_t max_documents;
    int64_t max_tokens_per_doc;
    int64_t ctx_size;                      /* 0 = the model's trained context          */
    int64_t queue_depth;
    int64_t max_running; /* /answer generations in the running batch           */
    int64_t batch_kv_mb; /* their KV memory before new ones wait in the queue  */
    int64_t batch_prefill_tokens; /* prompt tokens per batched step             */
    char kv_cache_type[8];        /* auto | f32 | f16                                 */
    char answer_prompt_path[8];   /* batch | step: the numerics of generation prompts */
    char rerank_path[8];          /* auto | batch | step: the numerics of /rerank's passes */
    int64_t rerank_lanes;         /* lanes of a /rerank sequence; 0 = by the backend      */
    int64_t logit_rows;           /* logit rows per forward call; 0 = by the backend      */
    int64_t batch_tokens;         /* tokens per forward call; 0 = by the backend          */
    int64_t request_timeout_ms;
    int64_t max_request_forward_tokens; /* admission: one request's estimated cost (422)  */
    int64_t max_queued_forward_tokens;  /* admission: the queued requests' cost (503)     */
    int64_t drain_timeout_ms;
    int64_t max_answer_tokens;
    char chat_template[32];                /* auto | raw | chatml | gemma | llama2 | llama3 */
    char moice[FITM_CONFIG_STR_BYTES];     /* MoICE sidecar path; "" = none              */
    char position_method[24];              /* none | moice | ms_poe | attention_buckets */
    char dummy_text[FITM_CONFIG_STR_BYTES];
    double calib_temperature;              /* method paper's t                          */
    char profile[FITM_CONFIG_STR_BYTES];   /* scoring profile; "" = <model>.profile if any */
    /* The scoring options' server defaults (score.h's names and syntax); "" = the
     * profile's, else the built-in default. */
    char rows[16], layers[FITM_CONFIG_STR_BYTES], heads[FITM_CONFIG_STR_BYTES];
    char aggregate[16], skip_first[16], reference[16], dummy_source[16], form[16];
    char head_query[16];
    char sink_factor[32], window[16], temperature[32], score_scale[32], score_bias[32];
    char fuse_weight[32], fuse_scale[32], fuse_bias[32], fuse_layers[FITM_CONFIG_STR_BYTES];
    char passages[16];
    /* /answer's defaults (score.h's fitm_answer_defaults keys); "" = the profile's, else
     * the built-in default. */
    char answer_calibrate[8], answer_reorder[24], answer_reorder_placement[8], answer_top_n[8];
    char rerank_method[24]; /* the method of /rerank requests that name none */
    char answer_template[FITM_CONFIG_STR_BYTES * 2]; /* "" = the built-in template */
    char answer_stop[72];                  /* the template's end of answer; "" = its default */
    char log_level[16];                    /* debug | info | warn | error              */
    char log_format[8];                    /* logfmt | json                            */
} fitm_config;

/* The scoring options set in cfg (the non-empty ones) into o (initialised by the caller).
 * Errors name the option. */
fitm_status fitm_config_score_opts(const fitm_config *cfg, fitm_score_opts *o,
                                   fitm_err *err);

/* /answer's defaults set in cfg (the non-empty ones) into d (the others unset). Errors name
 * the option. */
fitm_status fitm_config_answer_defaults(const fitm_config *cfg, fitm_answer_defaults *d,
                                        fitm_err *err);

/* Fills cfg with the defaults. */
void fitm_config_defaults(fitm_config *cfg);

/* Loads the settings in precedence order. argv may carry --config FILE (else FITM_CONFIG,
 * else no file); flags are --name value or --name=value with '-' or '_' accepted. Returns
 * FITM_ERR_INVALID with a message quoting the bad input. *help_out is set when --help or
 * --print-config was given (then the caller prints and exits 0). */
fitm_status fitm_config_load(fitm_config *cfg, int argc, char **argv, bool *help_out,
                             fitm_err *err);

/* Most keys api_keys may list. */
#define FITM_CONFIG_MAX_API_KEYS 32

/* The keys of an api_keys value: comma-separated, the spaces around each not part of it.
 * Copies the first max of them into keys (NULL: none) and returns how many there are. */
int fitm_config_api_keys(const char *list, char (*keys)[FITM_CONFIG_STR_BYTES], int max);

/* The FITM_* environment variables that name no option (FITM_CONFIG, FITM_CPU and the test
 * emulator's FITM_CUDA_EMU_* are known): up to max of them into vars, each the environment's
 * "NAME=value"; returns how many there are. A misspelt FITM_API_KEYS would otherwise start an
 * open server without a word. */
int fitm_config_unknown_env(const char **vars, int max);

/* Writes the documented option list (name, env var, default, bounds, help). */
void fitm_config_print_help(FILE *f);

/* Writes a config file with every option, its documentation and its current value. */
void fitm_config_print_file(FILE *f, const fitm_config *cfg);

#endif
