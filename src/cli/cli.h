/* cli: the `fitm` command's subcommands. Each takes argc/argv starting at the subcommand name
 * and returns the process exit code (0 ok, 1 failure, 2 usage error). */
#ifndef FITM_CLI_H
#define FITM_CLI_H

typedef int (*fitm_cli_fn)(int argc, char **argv);

/* Subcommands (one per cli_*.c). Add the declaration here and the row in fitm_main.c. */
int fitm_cli_mkmodel(int argc, char **argv); /* cli_mkmodel.c: write a tiny random model */
int fitm_cli_inspect(int argc, char **argv); /* cli_inspect.c: what a GGUF file holds */
int fitm_cli_generate(int argc, char **argv); /* cli_generate.c: greedy continuation */
int fitm_cli_tokenize(int argc, char **argv); /* cli_tokenize.c: text -> token ids (and back) */
int fitm_cli_pull(int argc, char **argv); /* cli_pull.c: download a model, resumably */

#endif
