/* answer_prompt: step 2 of an /answer: its prompt -- the answer template for a model without
 * a chat template, else the chat-wrapped prompt of docs/design.md (Method), with the documents
 * in the order step 1 chose and exact spans; or, for plain generation, the conversation in
 * the chat template -- and the intervention on the documents' spans in the chosen layers. */
#include "pipeline/answer_internal.h"

#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

/* ---- plain generation (no documents) ------------------------------------------------------ */

/* One piece of a rendered prompt: control markers (special) or text. */
typedef struct {
    const char *p;
    size_t n;
    bool special;
} piece;

/* A chat template's turn markers: open + role + mid, the content, close; `end` opens the
 * assistant's turn. model_role names the assistant in the markers (gemma: "model"). */
typedef struct {
    const char *name, *open, *mid, *close, *end, *model_role;
} turn_markers;

static const turn_markers markers[] = {
    {"gemma", "<start_of_turn>", "\n", "<end_of_turn>\n", "<start_of_turn>model\n", "model"},
    {"chatml", "<|im_start|>", "\n", "<|im_end|>\n", "<|im_start|>assistant\n", "assistant"},
    {"llama3", "<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>",
     "<|start_header_id|>assistant<|end_header_id|>\n\n", "assistant"},
};

/* Llama 2's chat format (Meta's): BOS [INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST]
 * {assistant} EOS BOS [INST] {user} [/INST] ...: a system message goes into the next user
 * turn; the BOS of the prompt is the tokenizer's. A user turn, with the held system message: */
static int32_t llama2_user(const char *content, const char **sys, bool after_answer, piece *ps)
{
    int32_t n = 0;
    if (after_answer)
        ps[n++] = (piece){"</s><s>", sizeof "</s><s>" - 1, true};
    ps[n++] = (piece){"[INST] ", sizeof "[INST] " - 1, true};
    if (*sys) {
        ps[n++] = (piece){"<<SYS>>\n", sizeof "<<SYS>>\n" - 1, true};
        ps[n++] = (piece){*sys, strlen(*sys), false};
        ps[n++] = (piece){"\n<</SYS>>\n\n", sizeof "\n<</SYS>>\n\n" - 1, true};
        *sys = NULL;
    }
    ps[n++] = (piece){content, strlen(content), false};
    ps[n++] = (piece){" [/INST]", sizeof " [/INST]" - 1, true};
    return n;
}

/* Message m's pieces: an answer as it is, a system message held for the next turn (one held
 * already gets a turn of its own first), any other as a user turn. */
static int32_t llama2_turn(const fitm_answer_message *m, const char **sys, bool after_answer,
                           piece *ps)
{
    int32_t n = 0;
    if (!strcmp(m->role, "assistant")) {
        ps[n++] = (piece){" ", 1, false};
        ps[n++] = (piece){m->content, strlen(m->content), false};
        ps[n++] = (piece){" ", 1, false};
        return n;
    }
    if (strcmp(m->role, "system"))
        return llama2_user(m->content, sys, after_answer, ps);
    if (*sys)
        n = llama2_user("", sys, after_answer, ps);
    *sys = m->content;
    return n;
}

/* The prompt's pieces into ps (room for 7 * n_messages + 8), their count. For a template
 * without markers (raw; llama2, whose turns are [INST] pairs) the pieces are written here too. */
static int32_t render_pieces(const fitm_session *s, const fitm_answer_request *req, piece *ps)
{
    const char *name = fitm_session_template(s);
    int32_t n = 0;
    if (req->raw_prompt) {
        ps[n++] = (piece){req->messages[0].content, strlen(req->messages[0].content), false};
        return n;
    }
    const turn_markers *tm = NULL;
    for (size_t i = 0; i < sizeof markers / sizeof markers[0]; i++)
        if (!strcmp(markers[i].name, name))
            tm = &markers[i];
    bool llama2 = !strcmp(name, "llama2");
    const char *sys = NULL; /* llama2: a system message waiting for its turn */
    bool answered = false;  /* llama2: an assistant turn is the last one written */
    for (int32_t i = 0; i < req->n_messages; i++) {
        const fitm_answer_message *m = &req->messages[i];
        bool assistant = !strcmp(m->role, "assistant");
        const char *c = m->content;
        if (tm) {
            /* gemma has no system turn: a system message is a user turn */
            const char *role = assistant ? tm->model_role
                               : !strcmp(tm->name, "gemma") && strcmp(m->role, "user") ? "user"
                                                                                       : m->role;
            ps[n++] = (piece){tm->open, strlen(tm->open), true};
            ps[n++] = (piece){role, strlen(role), false};
            ps[n++] = (piece){tm->mid, strlen(tm->mid), true};
            ps[n++] = (piece){c, strlen(c), false};
            ps[n++] = (piece){tm->close, strlen(tm->close), true};
        } else if (llama2) {
            const int32_t k = llama2_turn(m, &sys, answered, ps + n);
            n += k;
            answered = assistant || (answered && k == 0); /* a held system message: as before */
        } else { /* raw: a transcript */
            ps[n++] = (piece){m->role, strlen(m->role), false};
            ps[n++] = (piece){": ", 2, false};
            ps[n++] = (piece){c, strlen(c), false};
            ps[n++] = (piece){"\n", 1, false};
        }
    }
    if (llama2 && sys) /* a system message with no turn after it */
        n += llama2_user("", &sys, answered, ps + n);
    if (tm)
        ps[n++] = (piece){tm->end, strlen(tm->end), true};
    else if (!llama2)
        ps[n++] = (piece){"assistant:", 10, false};
    return n;
}

/* The pieces' texts in one malloc'd string. */
static fitm_status join_pieces(const piece *ps, int32_t n, char **out, size_t *len, fitm_err *err)
{
    size_t total = 0;
    for (int32_t i = 0; i < n; i++)
        total += ps[i].n;
    char *s = malloc(total + 1);
    if (!s)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt");
    size_t o = 0;
    for (int32_t i = 0; i < n; i++) {
        memcpy(s + o, ps[i].p, ps[i].n);
        o += ps[i].n;
    }
    s[o] = '\0';
    *out = s;
    *len = o;
    return FITM_OK;
}

static piece *pieces_alloc(const fitm_answer_request *req)
{
    return malloc((size_t)(7 * req->n_messages + 8) * sizeof(piece));
}

fitm_status fitm_answer_render(const fitm_session *s, const fitm_answer_request *req, char **out,
                               size_t *len, fitm_err *err)
{
    *out = NULL;
    piece *ps = pieces_alloc(req);
    if (!ps)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt");
    fitm_status st = join_pieces(ps, render_pieces(s, req, ps), out, len, err);
    free(ps);
    return st;
}

/* Appends the tokens of text[0..n) to *ids (cap grown as needed). */
static fitm_status encode_append(const fitm_tokenizer *tok, const char *text, size_t n,
                                 uint32_t flags, int32_t **ids, int64_t *n_ids, int64_t *cap,
                                 fitm_err *err)
{
    for (;;) {
        int64_t room = *cap - *n_ids, got = 0;
        fitm_status st = room > 0
                             ? fitm_tok_encode(tok, text, n, flags, *ids + *n_ids, room, &got, err)
                             : FITM_ERR_LIMIT;
        if (st == FITM_OK) {
            *n_ids += got;
            return FITM_OK;
        }
        if (st != FITM_ERR_LIMIT)
            return st;
        int64_t want = *cap * 2 + (int64_t)n + 16;
        int32_t *grown = realloc(*ids, (size_t)want * sizeof *grown);
        if (!grown)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt's tokens");
        *ids = grown;
        *cap = want;
    }
}

/* The rendered messages tokenized: a template's markers as control tokens; a transcript,
 * having none, in one piece. */
fitm_status fitm_answer_plain_prompt(const fitm_session *s, const fitm_answer_request *req,
                                     int64_t *T_out, fitm_answer_result *res, fitm_err *err)
{
    const fitm_tokenizer *tok = fitm_session_tokenizer(s);
    piece *ps = pieces_alloc(req);
    if (!ps)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt");
    int32_t n = render_pieces(s, req, ps);
    bool any_special = false;
    for (int32_t i = 0; i < n; i++)
        any_special |= ps[i].special;
    int64_t cap = 256, T = 0;
    res->tokens = malloc((size_t)cap * sizeof *res->tokens);
    fitm_status st = res->tokens ? FITM_OK : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (st == FITM_OK && !any_special) {
        char *text = NULL;
        size_t len = 0;
        if ((st = join_pieces(ps, n, &text, &len, err)) == FITM_OK)
            st = encode_append(tok, text, len, FITM_TOK_ADD_BOS, &res->tokens, &T, &cap, err);
        free(text);
    }
    for (int32_t i = 0; st == FITM_OK && any_special && i < n; i++) {
        uint32_t f = (i == 0 ? FITM_TOK_ADD_BOS : FITM_TOK_CONTINUATION) |
                     (ps[i].special ? FITM_TOK_PARSE_SPECIAL : 0);
        st = encode_append(tok, ps[i].p, ps[i].n, f, &res->tokens, &T, &cap, err);
    }
    free(ps);
    *T_out = T;
    if (st == FITM_OK && T < 1)
        st = fitm_err_set(err, FITM_ERR_INVALID, "the prompt is empty");
    return st;
}

/* The layers of the intervention: the request's, else the last half. */
static fitm_status intervention_layers(const fitm_answer_request *req, fitm_answer_plan *pl,
                                       fitm_err *err)
{
    if (!req->intervene_layers) {
        for (int32_t l = pl->L / 2; l < pl->L; l++)
            pl->use[l] = 1;
        return FITM_OK;
    }
    for (int32_t i = 0; i < req->n_intervene_layers; i++) {
        int32_t l = req->intervene_layers[i] < 0 ? req->intervene_layers[i] + pl->L
                                                 : req->intervene_layers[i];
        if (l < 0 || l >= pl->L)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'intervention_layers[%d]' = %d: the model has %d layers", (int)i,
                                (int)req->intervene_layers[i], (int)pl->L);
        pl->use[l] = 1;
    }
    return FITM_OK;
}

/* The documents' spans in request order and the intervention on them, from the end of the
 * last document on. */
static fitm_status intervention(const fitm_answer_request *req, fitm_answer_plan *pl,
                                fitm_answer_result *res, fitm_err *err)
{
    for (int32_t p = 0; p < pl->K; p++)
        res->spans[pl->order[p]] = pl->spans[p];
    fitm_status st = intervention_layers(req, pl, err);
    if (st != FITM_OK)
        return st;
    pl->iv = (fitm_intervention){.spans = pl->spans,
                                 .n_spans = pl->K,
                                 .alpha = pl->alpha,
                                 .layers = pl->use,
                                 .from_pos = pl->spans[pl->K - 1].end};
    pl->intervene = req->calibrate;
    return FITM_OK;
}

fitm_status fitm_answer_prompt(const fitm_session *s, const fitm_answer_request *req, bool plain,
                               fitm_answer_plan *pl, fitm_answer_result *res, fitm_err *err)
{
    const int64_t n_ctx = fitm_session_n_ctx(s);
    fitm_rerank_request rq = req->base;
    rq.docs = pl->docs;
    rq.n_docs = pl->K; /* the documents top_n kept, in their order */
    fitm_status st = plain ? fitm_answer_plain_prompt(s, req, &pl->T, res, err)
                           : fitm_rerank_prompt(s, &rq, fitm_session_answer_frame(s), NULL,
                                                &res->tokens, &pl->T, pl->spans, err);
    if (st != FITM_OK)
        return st;
    /* The prompt and its answer fit the context together (usage's total_tokens never exceeds
     * it, as OpenAI counts), so the prompt must leave room for one token. */
    if (pl->T >= n_ctx)
        return fitm_err_set(
            err, FITM_ERR_CONTEXT,
            "the prompt is %lld tokens, over the context of %lld tokens (less one for the "
            "answer)%s", (long long)pl->T, (long long)n_ctx,
            plain ? "" : ": send fewer or shorter documents");
    pl->max_gen = req->max_tokens < n_ctx - pl->T ? req->max_tokens : n_ctx - pl->T;
    int32_t *grown = realloc(res->tokens, (size_t)(pl->T + pl->max_gen) * sizeof *grown);
    res->spans = plain ? NULL : calloc((size_t)res->n_docs, sizeof *res->spans);
    if (grown)
        res->tokens = grown;
    if (!grown || (!plain && !res->spans))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    res->prompt_tokens = pl->T;
    pl->intervene = false;
    return plain ? FITM_OK : intervention(req, pl, res, err);
}
